"""Audit log growth under a flood of refused requests: one client sending, as fast as
it can, unauthenticated requests for 64 KiB paths to the real gateway (serve.listener, its own
state dir, no engine or Keycloak needed: such requests never reach them).

Two gateways in the same run, taking turns: the shipped one (refusals summarised per source and
interval, resources capped at 256 bytes) and, as the baseline, the same code with a summary
interval of 1 ms, where every refused request gets its own record, as before refusals were summarised (though
with the capped resource; the old raw 64 KiB path made each record about 260 times larger).
Reports the bytes one refused request adds on its own, the log's growth per second and per
request under the flood, and the ratio of the two gateways' growth.

Run: .venv/bin/python bench/audit_flood.py   Writes bench/results/audit_flood.json.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from appliance.home import HOME_ENV, Home
from audit.writer import log_files

RESULTS = Path(__file__).parent / "results" / "audit_flood.json"
PATH = "/v1/" + "A" * 65000  # about the longest URL httpx sends
FLOOD_S = 10.0
ROUNDS = 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def log_bytes(home: Home) -> int:
    return sum(path.stat().st_size for path in log_files(home.audit))


class Gateway:
    """serve.listener on a free port with a fresh state dir."""

    def __init__(self, root: Path, name: str, refusal_interval_s: float) -> None:
        self.home = Home(root / name).ensure()
        self.port = free_port()
        env = {**os.environ, HOME_ENV: str(self.home.root), "APPLIANCE_GATEWAY__PORT": str(self.port),
               "APPLIANCE_KEYCLOAK__MODE": "external",
               "APPLIANCE_KEYCLOAK__URL": "https://127.0.0.1:9", "APPLIANCE_KEYCLOAK__GATEWAY_CLIENT_SECRET": "unused",
               "APPLIANCE_AUDIT__REFUSAL_INTERVAL_S": str(refusal_interval_s)}
        self.process = subprocess.Popen([sys.executable, "-P", "-m", "serve.listener"], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{self.url}/healthz", timeout=1).raise_for_status()
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise SystemExit(f"gateway {name} did not start") from None
                time.sleep(0.2)

    def flood(self) -> tuple[int, float, int]:
        """(requests sent, seconds, bytes the log grew) for one client flooding for FLOOD_S."""
        before = log_bytes(self.home)
        sent = 0
        with httpx.Client(timeout=30) as http:
            started = time.monotonic()
            while time.monotonic() - started < FLOOD_S:
                assert http.get(f"{self.url}{PATH}").status_code == 404
                sent += 1
            elapsed = time.monotonic() - started
        time.sleep(1.5)  # the summary of the last interval is written
        return sent, elapsed, log_bytes(self.home) - before

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="apf-", dir="/tmp"))
    try:
        shipped = Gateway(root, "shipped", refusal_interval_s=1.0)
        baseline = Gateway(root, "baseline", refusal_interval_s=0.001)
        try:
            before = log_bytes(shipped.home)
            assert httpx.get(f"{shipped.url}{PATH}").status_code == 404
            single = log_bytes(shipped.home) - before
            rows: list[dict[str, Any]] = []
            for _ in range(ROUNDS):
                for name, gateway in (("shipped", shipped), ("baseline", baseline)):
                    sent, seconds, grown = gateway.flood()
                    rows.append({"gateway": name, "requests": sent, "seconds": round(seconds, 2), "bytes": grown,
                                 "requests_per_s": round(sent / seconds, 1),
                                 "log_bytes_per_s": round(grown / seconds, 1),
                                 "log_bytes_per_request": round(grown / sent, 2)})
                    print(json.dumps(rows[-1]))
        finally:
            shipped.stop()
            baseline.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def total(name: str, key: str) -> float:
        return float(sum(row[key] for row in rows if row["gateway"] == name))

    growth = {name: total(name, "bytes") / total(name, "seconds") for name in ("shipped", "baseline")}
    summary = {"path_bytes": len(PATH), "single_request_record_bytes": single,
               "shipped_log_bytes_per_s": round(growth["shipped"], 1),
               "baseline_log_bytes_per_s": round(growth["baseline"], 1),
               "growth_ratio_shipped_to_baseline": round(growth["shipped"] / growth["baseline"], 4),
               "rounds": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=1))
    RESULTS.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
