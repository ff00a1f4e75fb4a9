"""The cost of live compliance filtering per request, in this process: screening a chat prompt,
redacting a whole answer, and redacting a streamed answer event by event, under the default policy,
with today's scanner (appliance/sensitive.py: normalised text, separators decided by what they are
not, gitleaks' key rules, look-alike letters folded) and with the one before those (the same file
as of BEFORE_COMMIT, loaded from git), against what the gateway does to the same
request without filtering (parsing and re-encoding the same JSON: the relay's own work), the three
taking turns in the same run; and, for each scanner, the scan of each hostile megabyte (the body
limit) known to be slow for one of its detectors, the slowest named.

Run: .venv/bin/python -m bench.compliance_cost
Writes bench/results/compliance_cost.json.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.settings import ComplianceSettings
from bench.earlier import module_at
from serve.compliance import Compliance, Marks

RESULTS = Path(__file__).parent / "results" / "compliance_cost.json"
BEFORE_COMMIT = "c090e67"  # the last scanner with its own key shapes, before gitleaks' rules and the look-alike fold
ROUNDS = 5
REQUESTS = 200
WORDS = ("the", "model", "answers", "with", "a", "short", "paragraph", "about", "deployment", "on", "GPUs")
MEGABYTE = 1_000_000
HOSTILE = {  # a unit repeated to a megabyte
    "card-like groups": "4111 ", "ones and spaces": "1 ", "ones and dashes": "1-", "ones and commas": "1,",
    "one long number": "1", "an e-mail address's dots": "a.", "digits of three scripts": "\u0661\u0967\uff11 \u200b",
    "zero-width spaces": "1\u200b", "IBAN-like groups": "GB82 ",
    "IBANs failing mod 97": "GB82 WEST 1234 5698 7654 33, ", "sk- prefixes": "_sk-", "JWT prefixes": "eyJ-",
    "AKIA keys": "AKIA ", "phone numbers": "+1 415 555 2671 ",
    "JSON line breaks": "1\\n", "JSON-escaped digits": "\\u0031 "}


def text(words: int, sensitive: str) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(words)) + sensitive


PROMPT = {"model": "m", "messages": [{"role": "system", "content": text(60, ".")},
                                     {"role": "user", "content": text(300, " Mail me at ops@example.com.")}]}
ANSWER = text(200, " The card on file is 4111 1111 1111 1111.")
PIECES = [ANSWER[i:i + 4] for i in range(0, len(ANSWER), 4)]  # ~ one token per event


def events() -> list[bytes]:
    return [json.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m",
                        "choices": [{"index": 0, "delta": {"content": piece}, "logprobs": None,
                                     "finish_reason": "stop" if i == len(PIECES) - 1 else None}]}).encode()
            for i, piece in enumerate(PIECES)]


def filters() -> dict[str, Compliance]:
    new = Compliance(ComplianceSettings())
    old = Compliance(ComplianceSettings())
    earlier = module_at(BEFORE_COMMIT, "appliance/sensitive.py", "old_sensitive")
    old.scanner = earlier.Scanner(detectors=earlier.national_ids())
    return {"old": old, "new": new}


def work(compliance: Compliance | None) -> dict[str, Callable[[], object]]:
    """One request of each path: relayed bare (None), or screened by `compliance`."""
    body = json.dumps(PROMPT).encode()
    answer = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER}}]}).encode()
    stream = events()
    if compliance is None:
        return {"prompt": lambda: json.dumps(json.loads(body)), "answer": lambda: json.dumps(json.loads(answer)),
                "stream": lambda: [json.dumps(json.loads(event)) for event in stream]}
    policy = compliance.policy(["user"])

    def prompt() -> object:
        payload = json.loads(body)
        compliance.screen_prompt(payload, tuple(name for name in payload if name != "model"), policy, Marks())
        return json.dumps(payload)

    def whole() -> object:
        screen = compliance.answer_filter(policy, Marks())
        assert screen is not None
        return json.dumps(screen.answer(json.loads(answer)))

    def streamed() -> object:
        screen = compliance.answer_filter(policy, Marks())
        assert screen is not None
        sent = [json.dumps(screen.event(json.loads(event))) for event in stream]
        return sent + [json.dumps(event) for event in screen.finish()]

    return {"prompt": prompt, "answer": whole, "stream": streamed}


def timed(run: Callable[[], object]) -> float:
    """Microseconds per request over REQUESTS requests."""
    started = time.perf_counter()
    for _ in range(REQUESTS):
        run()
    return (time.perf_counter() - started) / REQUESTS * 1e6


def per_request(paths: dict[str, dict[str, Callable[[], object]]]) -> dict[str, dict[str, float]]:
    """Median microseconds per request of each path and workload, the paths taking turns each round."""
    rounds: dict[str, dict[str, list[float]]] = {path: {} for path in paths}
    for _ in range(ROUNDS):
        for workload in ("prompt", "answer", "stream"):
            for path, runs in paths.items():
                rounds[path].setdefault(workload, []).append(timed(runs[workload]))
    return {path: {workload: statistics.median(times) for workload, times in by.items()}
            for path, by in rounds.items()}


def hostile_seconds(compliance: Compliance) -> dict[str, float]:
    """CPU seconds to screen a prompt of each hostile megabyte (the gateway's whole screening, in
    one thread: its own time, whatever else the machine runs)."""
    policy = compliance.policy(["user"])
    seconds = {}
    for name, unit in HOSTILE.items():
        content = ("a@" if unit == "a." else "") + unit * (MEGABYTE // len(unit))
        payload: dict[str, Any] = {"messages": [{"role": "user", "content": content}]}
        started = time.process_time()
        try:
            compliance.screen_prompt(payload, ("messages",), policy, Marks())
        except Exception:  # refused: the scan was done
            pass
        seconds[name] = round(time.process_time() - started, 2)
    return seconds


def main() -> None:
    compliance = filters()
    medians = per_request({"bare": work(None), **{name: work(c) for name, c in compliance.items()}})
    stream_events = len(events())
    figures: dict[str, Any] = {}
    for workload in ("prompt", "answer", "stream"):
        bare = medians["bare"][workload]
        figures[workload] = {"bare_us": round(bare, 1), **{
            f"{name}_added_us": round(medians[name][workload] - bare, 1) for name in compliance},
            "new_over_old": round((medians["new"][workload] - bare) / (medians["old"][workload] - bare), 2)}
    for name in compliance:
        figures[f"stream_{name}_added_us_per_event"] = round(figures["stream"][f"{name}_added_us"] / stream_events, 1)
    hostile = {name: hostile_seconds(c) for name, c in compliance.items()}
    result = {"prompt_chars": len(json.dumps(PROMPT)), "answer_chars": len(ANSWER), "stream_events": stream_events,
              "requests_per_round": REQUESTS, "rounds": ROUNDS, **figures,
              "hostile_megabyte_cpu_s": hostile,
              "slowest_hostile_megabyte": {name: max(seconds.items(), key=lambda item: item[1])
                                           for name, seconds in hostile.items()}}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
