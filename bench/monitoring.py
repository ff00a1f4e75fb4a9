"""What monitoring costs, on an appliance of its own started here and taken down after:
- the gateway's added p50 (a request through the gateway with an API key, less the same request
  to the engine directly) while Prometheus scrapes every second (the gateway, the engines through
  its relay, itself, Alertmanager) against while Prometheus is stopped, the two taking turns over
  WINDOWS windows of ROUNDS requests;
- Prometheus's memory (resident) and its series count at the demo's scale, and its disk: the
  write-ahead log's growth while it scrapes every second, as bytes a day at 1 s and at the
  default 15 s interval (its compacted blocks take less than the log).

    .venv/bin/python -m bench.monitoring

Writes bench/results/monitoring.json.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from appliance.alerts import monitoring_auth
from appliance.engine_launch import engine_socket
from appliance.home import Home
from appliance.secrets import secret
from appliance.supervisor import Supervisor
from appliance.tls import local_trust
from bench.own_appliance import cli, own_appliance
from installer.monitoring import monitoring_dir
from installer.realm import BOOTSTRAP_SECRET
from serve.engine import ENGINE_KEY_SECRET
from tests.support.ports import free_port

RESULTS = Path(__file__).parent / "results" / "monitoring.json"
WINDOWS = 6  # stopped and scraping, taking turns (an even number: it ends scraping)
ROUNDS = 150
WARMUP = 10
SCRAPE_S = 1


def added_ms(home: Home, gateway_port: int, key: str, rounds: int) -> list[float]:
    """Per round: the gateway's /v1/models time less the engine's own, in milliseconds."""
    engine = httpx.Client(transport=httpx.HTTPTransport(uds=str(engine_socket(home, "main"))), base_url="http://e",
                          headers={"Authorization": f"Bearer {secret(home, ENGINE_KEY_SECRET)}"}, timeout=60)
    gateway = httpx.Client(base_url=f"http://127.0.0.1:{gateway_port}", timeout=60,
                           headers={"Authorization": f"Bearer {key}"})
    added = []
    with engine, gateway:
        for _ in range(rounds):
            times = []
            for client in (engine, gateway):
                started = time.perf_counter()
                answer = client.get("/v1/models")
                times.append(time.perf_counter() - started)
                if answer.status_code != 200:
                    raise SystemExit(f"{answer.status_code} {answer.text[:300]}")
            added.append((times[1] - times[0]) * 1000)
    return added


def wal_bytes(home: Home) -> int:
    return sum(p.stat().st_size for p in (monitoring_dir(home) / "prometheus" / "wal").rglob("*") if p.is_file())


def prometheus_figure(home: Home, url: str, expression: str) -> float:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expression}, auth=monitoring_auth(home),
                       verify=local_trust(home), timeout=10).json()
    return float(answer["data"]["result"][0]["value"][1])


def main() -> None:
    ports = {name: str(free_port()) for name in ("APPLIANCE_GATEWAY__PORT", "APPLIANCE_KEYCLOAK__PORT",
                                                  "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT")}
    settings = {**ports, "APPLIANCE_MONITORING__SCRAPE_INTERVAL_S": str(SCRAPE_S)}
    with own_appliance("mon-", settings) as (home, env):  # the administrator's 6000 requests a minute suffice
        cli(env, "up")
        cli(env, "token", "--user", "admin", "--password-stdin", stdin=secret(home, BOOTSTRAP_SECRET) + "\n")
        key = json.loads(cli(env, "keys", "create", "bench", "--user", "admin", "--json"))["secret"]
        gateway_port = int(ports["APPLIANCE_GATEWAY__PORT"])
        prometheus_url = f"https://127.0.0.1:{env['APPLIANCE_MONITORING__PROMETHEUS_PORT']}"
        supervisor = Supervisor(home)
        added_ms(home, gateway_port, key, WARMUP)
        windows: dict[str, list[float]] = {"scraping": [], "stopped": []}
        wal_growth: list[float] = []
        for window in range(WINDOWS):  # Prometheus runs after `up`: stopped first, then taking turns
            scraping = window % 2 == 1
            if scraping:
                supervisor.call("startProcess", "prometheus", True)
                time.sleep(3 * SCRAPE_S)  # its first scrapes are done
                wal_before, started = wal_bytes(home), time.monotonic()
            else:
                supervisor.call("stopProcess", "prometheus", True)
            windows["scraping" if scraping else "stopped"] += added_ms(home, gateway_port, key, ROUNDS)
            if scraping:
                wal_growth.append((wal_bytes(home) - wal_before) / (time.monotonic() - started))
        time.sleep(5 * SCRAPE_S)  # the last window scraped: Prometheus runs
        [prometheus] = [p for p in supervisor.processes() if p.name == "prometheus"]
        resident = psutil.Process(prometheus.pid).memory_info().rss
        series = prometheus_figure(home, prometheus_url, "prometheus_tsdb_head_series")
    p50 = {name: statistics.median(values) for name, values in windows.items()}
    per_day_1s = statistics.median(wal_growth) * 86400
    result: dict[str, Any] = {
        "bench": "monitoring", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "endpoint": "/v1/models with an API key, less the engine's own", "rounds_per_window": ROUNDS,
        "windows": WINDOWS, "scrape_interval_s": SCRAPE_S,
        "gateway_added_p50_ms": {name: round(value, 3) for name, value in p50.items()},
        "added_p50_ratio_scraping_vs_stopped": round(p50["scraping"] / p50["stopped"], 3),
        "prometheus_resident_mib": round(resident / 2**20, 1),
        "prometheus_head_series": int(series),
        "wal_bytes_per_day_at_1s": int(per_day_1s),
        "wal_bytes_per_day_at_15s": int(per_day_1s / 15),
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
