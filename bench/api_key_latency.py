"""What the gateway adds to a request made with an API key, against one made with a Keycloak
token whose signature it has already checked (its cache), on an appliance of its own started here
and taken down after. Three paths take turns, ROUNDS times: `/v1/models` from the engine directly
(its Unix socket), through the gateway with the token, through the gateway with the key. What the
gateway adds is a path's median less the engine's. The owner's roles and a token's state are
re-checked with Keycloak every `gateway.introspect_ttl_s` (10 s by default) on both paths.

    .venv/bin/python -m bench.api_key_latency

Writes bench/results/api_key_latency.json.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from appliance.engine_launch import engine_socket
from appliance.home import Home
from appliance.secrets import secret
from bench.own_appliance import cli, own_appliance
from installer.realm import BOOTSTRAP_SECRET
from serve.engine import ENGINE_KEY_SECRET

RESULTS = Path(__file__).parent / "results" / "api_key_latency.json"
ROUNDS = 600
WARMUP = 20
PORT = 18680


def token(env: dict[str, str], user: str, password: str) -> str:
    """A fresh access token of `user` (the cached login is left as it is)."""
    return cli(env, "token", "--user", user, "--password-stdin", "--print", stdin=password + "\n").strip()


def measure(home: Home, bearer_token: str, key: str) -> dict[str, list[float]]:
    engine = httpx.Client(transport=httpx.HTTPTransport(uds=str(engine_socket(home, "main"))), base_url="http://e",
                          headers={"Authorization": f"Bearer {secret(home, ENGINE_KEY_SECRET)}"}, timeout=60)
    gateway = httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=60)
    paths = {"engine": (engine, {}), "token": (gateway, {"Authorization": f"Bearer {bearer_token}"}),
             "key": (gateway, {"Authorization": f"Bearer {key}"})}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for round_ in range(WARMUP + ROUNDS):
        for name, (client, headers) in paths.items():
            started = time.perf_counter()
            answer = client.get("/v1/models", headers=headers)
            elapsed = time.perf_counter() - started
            if answer.status_code != 200:
                raise SystemExit(f"{name}: {answer.status_code} {answer.text[:300]}")
            if round_ >= WARMUP:
                times[name].append(elapsed * 1000)
    return times


def main() -> None:
    ports = {"APPLIANCE_GATEWAY__PORT": str(PORT), "APPLIANCE_KEYCLOAK__PORT": "18690",
             "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": "18691"}
    with own_appliance("akl-", ports) as (home, env):
        cli(env, "up")
        password = secret(home, BOOTSTRAP_SECRET)
        cli(env, "token", "--user", "admin", "--password-stdin", stdin=password + "\n")  # the login keys need
        admin_token = token(env, "admin", password)
        # The administrator's rate limit lets ROUNDS x 2 requests a minute pass.
        made = json.loads(cli(env, "keys", "create", "bench", "--user", "admin", "--json"))
        times = measure(home, admin_token, made["secret"])
    p50 = {name: statistics.median(values) for name, values in times.items()}
    added = {name: p50[name] - p50["engine"] for name in ("token", "key")}
    result: dict[str, Any] = {
        "bench": "api_key_latency", "rounds": ROUNDS, "endpoint": "/v1/models",
        "p50_ms": {name: round(value, 3) for name, value in p50.items()},
        "p90_ms": {name: round(statistics.quantiles(values, n=10)[-1], 3) for name, values in times.items()},
        "gateway_added_p50_ms": {name: round(value, 3) for name, value in added.items()},
        "key_to_token_added_ratio": round(added["key"] / added["token"], 3),
        "host": f"{os.cpu_count()} cores", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
