"""What clients see while a limit changes: `settings set` of a `gateway.limits` key then
`settings apply` (the gateway takes it while it serves) against the same change put in force by
`appliance down` then `appliance up`, on an appliance of the bench's own. Clients send one-token
chat requests with an API key throughout, each at most every CLIENT_PERIOD_S; the trials take
turns. For each: the requests sent during it that failed (an error status or no connection), those
sent, and the longest time without a successful answer.

Run: .venv/bin/python -m bench.settings_apply   (after ./bootstrap.sh --no-start)
Writes bench/results/settings_apply.json.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.engine_start import api_key
from bench.own_appliance import cli, own_appliance
from tests.support.ports import free_port

RESULTS = Path(__file__).parent / "results" / "settings_apply.json"
TRIALS = 2  # of each way, taking turns
CLIENTS = 4
CLIENT_PERIOD_S = 0.25
KEY = "gateway.limits.user.max_tokens"  # well above the requests' 1 token: the change refuses none
VALUES = (4000, 4001)


class Clients:
    """CLIENTS threads asking until stopped; every request's (sent, answered, ok)."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.done: list[tuple[float, float, bool]] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._ask, daemon=True) for _ in range(CLIENTS)]

    def _ask(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    ok = http.post(self.url, headers={"Authorization": f"Bearer {self.key}"},
                                   json={"model": "SmolLM2-135M-Instruct", "max_tokens": 1,
                                         "messages": [{"role": "user", "content": "Hi"}]}).status_code == 200
                except httpx.HTTPError:
                    ok = False
                answered = time.monotonic()
                with self.lock:
                    self.done.append((sent, answered, ok))
                time.sleep(max(0.0, CLIENT_PERIOD_S - (answered - sent)))

    def during(self, start: float, end: float) -> dict[str, float]:
        """The requests sent in [start, end], and the longest time in it without a success."""
        with self.lock:
            sent = [r for r in self.done if start <= r[0] <= end]
            successes = sorted(r[1] for r in self.done if r[2] and start <= r[1] <= end)
        edges = [start, *successes, end]
        return {"sent": len(sent), "failed": sum(not ok for _, _, ok in sent),
                "longest_without_answer_s": round(max(b - a for a, b in zip(edges, edges[1:], strict=False)), 2),
                "seconds": round(end - start, 1)}


def settle(clients: Clients, seconds: float = 5.0) -> None:
    """Wait until the clients have had answers for `seconds` running (after an `up`)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        now = time.monotonic()
        if clients.during(now - seconds, now)["failed"] == 0 and clients.during(now - seconds, now)["sent"]:
            return
        time.sleep(1)
    raise SystemExit("the clients had no answers for 600 s")


def main() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    port = free_port()
    settings = {"APPLIANCE_GATEWAY__PORT": str(port), "APPLIANCE_KEYCLOAK__PORT": str(free_port()),
                "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": str(free_port())}
    trials: dict[str, list[dict[str, float]]] = {"apply": [], "down_up": []}
    with own_appliance("aps-", settings) as (home, env):
        cli(env, "up")
        clients = Clients(f"http://127.0.0.1:{port}/v1/chat/completions", api_key(env, home))
        for thread in clients.threads:
            thread.start()
        settle(clients)
        turn = 0
        for _ in range(TRIALS):
            for way in ("apply", "down_up"):
                value = VALUES[turn % 2]
                turn += 1
                start = time.monotonic()
                cli(env, "settings", "set", KEY, str(value))
                if way == "apply":
                    shown = cli(env, "settings", "apply", "--json")
                    assert json.loads(shown)["taken_live"] == ["gateway"], shown
                else:
                    cli(env, "down")
                    cli(env, "up")
                end = time.monotonic()
                trials[way].append(clients.during(start, end))
                settle(clients)
        clients.stop.set()
        for thread in clients.threads:
            thread.join(timeout=90)

    def median(way: str, field: str) -> float:
        return round(statistics.median(t[field] for t in trials[way]), 2)

    result: dict[str, object] = {
        "bench": "settings_apply",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host_cpus": len(os.sched_getaffinity(0)),
        "change": f"{KEY} {VALUES[0]} <-> {VALUES[1]}",
        "clients": CLIENTS, "client_period_s": CLIENT_PERIOD_S, "trials": TRIALS,
        "apply_failed": median("apply", "failed"), "apply_sent": median("apply", "sent"),
        "apply_longest_without_answer_s": median("apply", "longest_without_answer_s"),
        "apply_s": median("apply", "seconds"),
        "down_up_failed": median("down_up", "failed"), "down_up_sent": median("down_up", "sent"),
        "down_up_longest_without_answer_s": median("down_up", "longest_without_answer_s"),
        "down_up_s": median("down_up", "seconds"),
        "each": trials,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for name, figure in result.items():
        print(f"{name:34} {figure}")


if __name__ == "__main__":
    main()
