"""How long an engine wedged (SIGSTOP: alive, its socket accepting, answering nothing) takes to
serve again through the gateway, the watchdog restarting it, against an engine that crashed
(SIGKILL: supervisord restarts it at once), on an appliance of the bench's own with the watchdog's
default settings. The trials take turns; the difference is what detecting a wedge costs
(`watchdog.engine_stall_s` plus the looks before it is seen). Also measured: how long the first
request sent right after the wedge waits for its answer (a 503 from the gateway's router, which
gives up on an engine that has not answered for a few seconds; before it did, the client's own
timeout, 60 s here).

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

from appliance.settings import WatchdogSettings
from appliance.supervisor import ProcessState, Supervisor
from audit.writer import log_files
from bench.engine_start import api_key
from bench.own_appliance import cli, own_appliance
from tests.support.ports import free_port

RESULTS = Path(__file__).parent / "results" / "watchdog.json"
TRIALS = 3
CLIENT_TIMEOUT_S = 60.0
# Between trials: the watchdog sees the replica answer before it is wedged again (a replica that
# never answered since it started is judged only after its start timeout, 600 s).
SETTLE_S = 5


def engine_pid(supervisor: Supervisor) -> int:
    [info] = [p for p in supervisor.processes() if p.name == "vllm-main"]
    return info.pid if info.state == ProcessState.RUNNING else 0


def answer(url: str, key: str) -> int:
    """The gateway's status for a one-token chat request; 0 for none within CLIENT_TIMEOUT_S."""
    try:
        return httpx.post(url, headers={"Authorization": f"Bearer {key}"}, timeout=CLIENT_TIMEOUT_S,
                          json={"model": "SmolLM2-135M-Instruct", "max_tokens": 1,
                                "messages": [{"role": "user", "content": "Hi"}]}).status_code
    except httpx.HTTPError:
        return 0


def serves(url: str, key: str) -> bool:
    return answer(url, key) == 200


def recovery_s(supervisor: Supervisor, how: signal.Signals, url: str, key: str) -> tuple[int, float, float]:
    """From sending `how` to the engine's processes: the first request's status (sent at once; 0:
    none within the client's timeout), seconds to it, and to the gateway's next answer from the
    engine."""
    pid = engine_pid(supervisor)
    assert pid and serves(url, key), "the engine does not serve before the trial"
    os.killpg(pid, how)
    sent = time.monotonic()
    try:
        status = answer(url, key)
        first = time.monotonic() - sent
        while not (engine_pid(supervisor) not in (0, pid) and serves(url, key)):
            if time.monotonic() - sent > 600:
                raise SystemExit(f"no answer 600 s after {how.name}")
            time.sleep(0.5)
        return status, first, time.monotonic() - sent
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
                "APPLIANCE_WATCHDOG__BACKOFF_S": "5", "APPLIANCE_WATCHDOG__MAX_BACKOFF_S": "60"}
    crashed: list[float] = []
    wedged: list[float] = []
    first_answers: list[float] = []
    first_statuses: list[int] = []
    with own_appliance("apw-", settings) as (home, env):
        cli(env, "up")
        key = api_key(env, home)
        supervisor, url = Supervisor(home), f"http://127.0.0.1:{port}/v1/chat/completions"
        for _ in range(TRIALS):
            crashed.append(recovery_s(supervisor, signal.SIGKILL, url, key)[2])
            time.sleep(SETTLE_S)
            status, first, served = recovery_s(supervisor, signal.SIGSTOP, url, key)
            first_answers.append(first)
            first_statuses.append(status)
            wedged.append(served)
            time.sleep(SETTLE_S)
        restarts = [r for r in (json.loads(line) for path in log_files(home.audit)
                                for line in path.read_bytes().splitlines()) if r["action"] == "engine.restarted"]
    crash, wedge = statistics.median(crashed), statistics.median(wedged)
    result = {
        "bench": "watchdog",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host_cpus": len(os.sched_getaffinity(0)),
        "engine_stall_s": WatchdogSettings().engine_stall_s,
        "check_interval_s": WatchdogSettings().check_interval_s,
        "trials": TRIALS,
        "wedge_to_first_answer_s": round(statistics.median(first_answers), 1),
        "crash_to_served_s": round(crash, 1),
        "wedge_to_served_s": round(wedge, 1),
        "wedge_vs_crash": round(wedge / crash, 2),
        "detection_s": round(wedge - crash, 1),
        "each": {"crash": [round(s, 1) for s in crashed], "wedge": [round(s, 1) for s in wedged],
                 "wedge_first_answer": [round(s, 1) for s in first_answers],
                 "wedge_first_status": first_statuses},
        "watchdog_restarts_audited": len(restarts),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for name, value in result.items():
        print(f"{name:28} {value}")


if __name__ == "__main__":
    main()
