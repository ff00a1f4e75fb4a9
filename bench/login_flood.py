"""The gateway's memory under a flood of anonymous bodies sent to its published login endpoints:
ROUNDS floods of CLIENTS concurrent 1 MB password-grant bodies to the token endpoint over HTTPS, as
the security review sent them, against the real gateway (serve.listener, a state dir of its own
with the appliance's CA, Keycloak's port closed: the bodies never need it).

Two gateways in the same run, taking turns: the shipped one and, as the baseline, the same code
with the listener as it was before it bounded what a connection's TLS layer reads (the kernel's
autotuned receive buffer, uvloop's 256 KiB TLS high-water mark, glibc's moving mmap threshold).
Both answer the bodies 413 from their Content-Length (the token endpoint's bound is 16 KiB) and
let every source through (login_burst very large), so the figures are the bodies' alone. Reports
each gateway's resident memory before, at its peak during and after each flood (VmRSS, sampled
every 20 ms), and the ratios of their growth.

Run: .venv/bin/python -m bench.login_flood   Writes bench/results/login_flood.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from appliance.home import HOME_ENV, Home
from appliance.tls import ca_file, ensure_ca

RESULTS = Path(__file__).parent / "results" / "login_flood.json"
CLIENTS = 200
BODY_BYTES = 1_000_000
ROUNDS = 3
SETTLE_S = 3.0
TOKEN = "/realms/appliance/protocol/openid-connect/token"
# The baseline: the shipped code with the listener's bounds on a connection's reading undone.
BASELINE = ("import serve.listener as listener; "
            "listener.give_back_large_blocks = lambda: False; "
            "listener.GuardedHttpToolsProtocol._set_window = lambda self, size: None; "
            "listener.TLS_READ_HIGH_WATER = 262144; "  # uvloop's own
            "listener.main()")
SHIPPED = "from serve.listener import main; main()"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class Gateway:
    """serve.listener on a free port, HTTPS with a public URL, with a fresh state dir."""

    def __init__(self, root: Path, name: str, code: str) -> None:
        self.home = Home(root / name).ensure()
        ensure_ca(self.home)
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        env = {**os.environ, HOME_ENV: str(self.home.root), "APPLIANCE_GATEWAY__PORT": str(self.port),
               "APPLIANCE_GATEWAY__TLS": "on", "APPLIANCE_GATEWAY__PUBLIC_URL": self.url,
               "APPLIANCE_GATEWAY__LOGIN_BURST": "10000", "APPLIANCE_GATEWAY__LOGIN_ATTEMPTS_PER_MINUTE": "6000",
               "APPLIANCE_GATEWAY__INTROSPECT_TTL_S": "0", "APPLIANCE_KEYCLOAK__EVENTS_POLL_S": "0",
               "APPLIANCE_KEYCLOAK__PORT": str(free_port())}
        self.process = subprocess.Popen([sys.executable, "-P", "-c", code], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.tls = ssl.create_default_context(cafile=str(ca_file(self.home)))
        deadline = time.monotonic() + 90
        while True:
            try:
                httpx.get(f"{self.url}/healthz", timeout=1, verify=self.tls).raise_for_status()
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise SystemExit(f"gateway {name} did not start (see {self.home.logs})") from None
                time.sleep(0.2)

    def flood(self) -> dict[str, Any]:
        """One flood: the gateway's memory before, at its peak and SETTLE_S after; the answers."""
        before = rss_bytes(self.process.pid)
        peak = [before]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_bytes(self.process.pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()
        outcomes = asyncio.run(self._send())
        seconds = time.monotonic() - started
        time.sleep(SETTLE_S)
        done.set()
        sampler.join()
        after = rss_bytes(self.process.pid)
        mib = 1 << 20
        return {"seconds": round(seconds, 2), "outcomes": dict(outcomes), "rss_before_mib": round(before / mib, 1),
                "rss_peak_mib": round(peak[0] / mib, 1), "rss_after_mib": round(after / mib, 1),
                "peak_growth_mib": round((peak[0] - before) / mib, 1),
                "kept_growth_mib": round((after - before) / mib, 1)}

    async def _send(self) -> Counter[str]:
        body = b"grant_type=password&client_id=appliance-cli&username=admin&password=" + b"x" * BODY_BYTES
        outcomes: Counter[str] = Counter()
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(verify=self.tls, timeout=60, limits=limits) as http:
            async def one() -> None:
                try:
                    answer = await http.post(f"{self.url}{TOKEN}", content=body,
                                             headers={"content-type": "application/x-www-form-urlencoded"})
                    outcomes[str(answer.status_code)] += 1
                except httpx.HTTPError as exc:  # the gateway closed the connection before the body ended
                    outcomes[type(exc).__name__] += 1
            await asyncio.gather(*(one() for _ in range(CLIENTS)))
        return outcomes

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="alf-", dir="/tmp"))
    rows: list[dict[str, Any]] = []
    try:
        gateways = {"shipped": Gateway(root, "shipped", SHIPPED), "baseline": Gateway(root, "baseline", BASELINE)}
        try:
            for round_ in range(ROUNDS):
                for name, gateway in (gateways.items() if round_ % 2 == 0 else reversed(gateways.items())):
                    rows.append({"gateway": name, "round": round_, **gateway.flood()})
                    print(json.dumps(rows[-1]))
        finally:
            for gateway in gateways.values():
                gateway.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def total(name: str, key: str) -> float:
        return float(sum(row[key] for row in rows if row["gateway"] == name))

    def worst(name: str, key: str) -> float:
        return float(max(row[key] for row in rows if row["gateway"] == name))

    summary = {
        "clients": CLIENTS, "body_bytes": BODY_BYTES, "rounds": ROUNDS,
        "shipped_peak_growth_mib_max": worst("shipped", "peak_growth_mib"),
        "baseline_peak_growth_mib_max": worst("baseline", "peak_growth_mib"),
        "shipped_rss_after_last_mib": [r for r in rows if r["gateway"] == "shipped"][-1]["rss_after_mib"],
        "baseline_rss_after_last_mib": [r for r in rows if r["gateway"] == "baseline"][-1]["rss_after_mib"],
        "peak_growth_ratio_shipped_to_baseline": round(
            total("shipped", "peak_growth_mib") / max(total("baseline", "peak_growth_mib"), 0.1), 3),
        "kept_growth_ratio_shipped_to_baseline": round(
            total("shipped", "kept_growth_mib") / max(total("baseline", "kept_growth_mib"), 0.1), 3),
        "floods": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "floods"}, indent=1))
    RESULTS.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
