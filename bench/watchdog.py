"""How long an engine wedged (SIGSTOP: alive, its socket accepting, answering nothing) takes to
serve again through the gateway, the watchdog restarting it, against an engine that crashed
(SIGKILL: supervisord restarts it at once), on an appliance of the bench's own. The trials take
turns; the difference is what detecting a wedge costs (`watchdog.engine_stall_s`, here STALL_S,
plus the looks before it is seen).

Run: .venv/bin/python -m bench.watchdog   (after ./bootstrap.sh --no-start)
Writes bench/results/watchdog.json.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

from appliance.supervisor import ProcessState, Supervisor
from audit.writer import log_files
from bench.engine_start import api_key
from bench.own_appliance import cli, own_appliance
from tests.support.ports import free_port

RESULTS = Path(__file__).parent / "results" / "watchdog.json"
TRIALS = 3
STALL_S = 20
# Between trials: the watchdog sees the replica answer before it is wedged again (a replica that
# never answered since it started is judged only after its start timeout, 600 s).
SETTLE_S = 5


def engine_pid(supervisor: Supervisor) -> int:
    [info] = [p for p in supervisor.processes() if p.name == "vllm-main"]
    return info.pid if info.state == ProcessState.RUNNING else 0


def serves(url: str, key: str) -> bool:
    try:
        return httpx.post(url, headers={"Authorization": f"Bearer {key}"}, timeout=30,
                          json={"model": "SmolLM2-135M-Instruct", "max_tokens": 1,
                                "messages": [{"role": "user", "content": "Hi"}]}).status_code == 200
    except httpx.HTTPError:
        return False


def recovery_s(supervisor: Supervisor, how: signal.Signals, url: str, key: str) -> float:
    """Seconds from sending `how` to the engine's processes to the gateway's next answer from it."""
    pid = engine_pid(supervisor)
    assert pid and serves(url, key), "the engine does not serve before the trial"
    os.killpg(pid, how)
    sent = time.monotonic()
    try:
        while not (engine_pid(supervisor) not in (0, pid) and serves(url, key)):
            if time.monotonic() - sent > 600:
                raise SystemExit(f"no answer 600 s after {how.name}")
            time.sleep(0.5)
        return time.monotonic() - sent
    finally:
        if how == signal.SIGSTOP:
            try:
                os.killpg(pid, signal.SIGCONT)  # only if the watchdog left it: it should be gone
            except ProcessLookupError:
                pass


def main() -> None:
    # Unwind on SIGTERM/SIGINT, so that the appliance is taken down (own_appliance's `finally`).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    port = free_port()
    settings = {"APPLIANCE_GATEWAY__PORT": str(port), "APPLIANCE_KEYCLOAK__PORT": str(free_port()),
                "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": str(free_port()),
                "APPLIANCE_WATCHDOG__ENGINE_STALL_S": str(STALL_S), "APPLIANCE_WATCHDOG__CHECK_INTERVAL_S": "1",
                "APPLIANCE_WATCHDOG__BACKOFF_S": "5", "APPLIANCE_WATCHDOG__MAX_BACKOFF_S": "60"}
    crashed: list[float] = []
    wedged: list[float] = []
    with own_appliance("apw-", settings) as (home, env):
        cli(env, "up")
        key = api_key(env, home)
        supervisor, url = Supervisor(home), f"http://127.0.0.1:{port}/v1/chat/completions"
        for _ in range(TRIALS):
            crashed.append(recovery_s(supervisor, signal.SIGKILL, url, key))
            time.sleep(SETTLE_S)
            wedged.append(recovery_s(supervisor, signal.SIGSTOP, url, key))
            time.sleep(SETTLE_S)
        restarts = [r for r in (json.loads(line) for path in log_files(home.audit)
                                for line in path.read_bytes().splitlines()) if r["action"] == "engine.restarted"]
    crash, wedge = statistics.median(crashed), statistics.median(wedged)
    result = {
        "bench": "watchdog",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host_cpus": len(os.sched_getaffinity(0)),
        "engine_stall_s": STALL_S,
        "check_interval_s": 1,
        "trials": TRIALS,
        "crash_to_served_s": round(crash, 1),
        "wedge_to_served_s": round(wedge, 1),
        "wedge_vs_crash": round(wedge / crash, 2),
        "detection_s": round(wedge - crash, 1),
        "each": {"crash": [round(s, 1) for s in crashed], "wedge": [round(s, 1) for s in wedged]},
        "watchdog_restarts_audited": len(restarts),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for name, value in result.items():
        print(f"{name:28} {value}")


if __name__ == "__main__":
    main()
