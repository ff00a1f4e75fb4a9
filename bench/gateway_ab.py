"""The gateway as of an earlier commit and as it is now, side by side in one run: concurrency 1,
each request interleaved with the other gateway's and with each one's own stand-in engine, so the
VM's phase hits both alike (two separate runs of bench/gateway_overhead.py, hours apart, differed
by more than the code did). Each gateway's added p50 is against its own stub: the earlier one's
reached over TCP (its engines listened on ports), the current one's over its Unix socket.

Run: .venv/bin/python bench/gateway_ab.py [--before REV] [--requests N]
(needs ./bootstrap.sh --no-start; REV defaults to the commit before issue 17's hardening).
Writes bench/results/gateway_ab.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gateway_overhead as g  # the sibling bench: its appliance set-up, paths and interleaved load
import httpx

from appliance.engine_launch import engine_socket
from appliance.home import HOME_ENV, Home
from appliance.secrets import gateway_client_secret, secret
from appliance.settings import load_settings
from appliance.tls import ca_file, keycloak_ssl, tls_dir
from installer.realm import BOOTSTRAP_SECRET

PROJECT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "gateway_ab.json"
BEFORE = "ca02cc2"  # the last commit before issue 17's hardening

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--before", default=BEFORE, help="the earlier commit (its engines on TCP ports)")
parser.add_argument("--requests", type=int, default=400, help="requests per path and shape")
options = parser.parse_args()
old_tree = Path(tempfile.mkdtemp(prefix="gw-before-"))
subprocess.run(["git", "worktree", "add", "--detach", "-f", str(old_tree), options.before], cwd=PROJECT, check=True,
               capture_output=True)
root, env = g.start_appliance()
home = Home(Path(env[HOME_ENV]))
procs = []
try:
    settings = load_settings(home.settings_file, environ=env)
    def token():
        body = httpx.post(f"{settings.keycloak.issuer}/protocol/openid-connect/token",
                          data={"grant_type": "password", "client_id": "appliance-cli", "username": "admin",
                                "password": secret(home, BOOTSTRAP_SECRET)}, verify=keycloak_ssl(settings, home)).json()
        return {"Authorization": f"Bearer {body['access_token']}"}
    new_home = Home(home.root.with_name("stubnew")).ensure()
    shutil.copytree(home.secrets, new_home.secrets, dirs_exist_ok=True)
    shutil.copytree(tls_dir(home), tls_dir(new_home), dirs_exist_ok=True)  # trusts Keycloak through the CA
    sock = engine_socket(new_home, "main")
    sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    old_home = Home(home.root.with_name("stubold")).ensure()
    shutil.copytree(home.secrets, old_home.secrets, dirs_exist_ok=True)
    procs.append(subprocess.Popen([sys.executable, "-m", "uvicorn", "bench.stub_engine:app", "--uds", str(sock),
                                   "--log-level", "warning"], cwd=PROJECT))
    procs.append(subprocess.Popen([sys.executable, "-m", "uvicorn", "bench.stub_engine:app", "--port", "18412",
                                   "--log-level", "warning"], cwd=PROJECT))
    base = {k: v for k, v in env.items() if k != "APPLIANCE_GATEWAY__LIMITS"}
    limits = "{ admin = { requests_per_minute = 10000000, tokens_per_minute = 1000000000, max_concurrent = 10000 } }"
    procs.append(subprocess.Popen([sys.executable, "-P", "-m", "serve.listener"], cwd=PROJECT,
        env={**base, HOME_ENV: str(new_home.root), "APPLIANCE_GATEWAY__PORT": "18481",
             "APPLIANCE_GATEWAY__LIMITS": limits,
             "APPLIANCE_POOLS__MAIN__SERVED_MODEL_NAME": g.MODEL}, stderr=subprocess.DEVNULL))
    procs.append(subprocess.Popen([sys.executable, "-P", "-m", "uvicorn", "serve.gateway:app_from_env", "--factory",
                                   "--port", "18482", "--no-access-log", "--log-level", "warning"], cwd=old_tree,
        # The gateway before issue 17 knew the embedded Keycloak only over plain HTTP: it reaches the
        # TLS one as an "external" Keycloak, trusting the CA through SSL_CERT_FILE (httpx reads it).
        env={**base, "PYTHONPATH": str(old_tree), HOME_ENV: str(old_home.root),
             "APPLIANCE_GATEWAY__PORT": "18482",
             "SSL_CERT_FILE": str(ca_file(home)), "APPLIANCE_KEYCLOAK__MODE": "external",
             "APPLIANCE_KEYCLOAK__URL": settings.keycloak.base_url,
             "APPLIANCE_KEYCLOAK__GATEWAY_CLIENT_SECRET": gateway_client_secret(settings, home),
             "APPLIANCE_GATEWAY__LIMITS": ("{ admin = { requests_per_minute = 10000000, "
                                           "tokens_per_minute = 1000000000 } }"),
             "APPLIANCE_POOLS__MAIN__PORT": "18412", "APPLIANCE_POOLS__MAIN__SERVED_MODEL_NAME": g.MODEL},
        stderr=subprocess.DEVNULL))
    for url in ("http://127.0.0.1:18481/healthz", "http://127.0.0.1:18482/healthz", "http://127.0.0.1:18412/health"):
        g.wait_for(url)
    time.sleep(2)
    headers = token()
    paths = {"before": ("http://127.0.0.1:18482/v1/chat/completions", headers),
             "after": ("http://127.0.0.1:18481/v1/chat/completions", headers),
             "stub_tcp": ("http://127.0.0.1:18412/v1/chat/completions", {}),
             "stub_uds": (f"unix:{sock}::/v1/chat/completions", {})}
    rows = []
    gateways = {"before": procs[-1].pid, "after": procs[-2].pid}
    for stream in (False, True):
        cpu_at_start = {name: g.cpu_seconds(pid) for name, pid in gateways.items()}
        samples = asyncio.run(g.load_interleaved(paths, stream, options.requests))
        # CPU per request of each gateway process (the warm-up request included): less noisy than latency.
        cpu_ms = {name: round((g.cpu_seconds(pid) - cpu_at_start[name]) * 1000 / (options.requests + 1), 3)
                  for name, pid in gateways.items()}
        p50 = {name: round(g.percentile(v, 0.5) * 1000, 3) for name, v in samples.items()}
        before, after = p50["before"] - p50["stub_tcp"], p50["after"] - p50["stub_uds"]
        rows.append({"stream": stream, "requests": options.requests, "p50_ms": p50,
                     "before_added_p50_ms": round(before, 3), "after_added_p50_ms": round(after, 3),
                     "added_ratio_after_to_before": round(after / before, 3),
                     "p50_ratio_after_to_before": round(p50["after"] / p50["before"], 3),
                     # The change's cost in the gateway's added latency: both gateways relay to the same
                     # instant stub app, so the difference of their end-to-end p50 is the gateways' own
                     # (the engine hop's transport, TCP before and a Unix socket after, included).
                     "change_cost_pct_of_added_p50": round((p50["after"] - p50["before"]) * 100 / before, 1),
                     "gateway_cpu_ms_per_request": cpu_ms,
                     "cpu_ratio_after_to_before": round(cpu_ms["after"] / cpu_ms["before"], 3)})
        print(json.dumps(rows[-1]), flush=True)
    RESULTS.write_text(json.dumps({"bench": "gateway_ab", "before": options.before,
                                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}, indent=1)
                       + "\n")
finally:
    for process in procs:
        process.terminate()
        process.wait(30)
    subprocess.run([g.APPLIANCE, "down"], env=env, capture_output=True)
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=PROJECT, capture_output=True)
