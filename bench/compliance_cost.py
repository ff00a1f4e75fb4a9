"""The cost of live compliance filtering per request (issue 21), in this process: screening a chat
prompt, redacting a whole answer, and redacting a streamed answer event by event, under the default
policy, against what the gateway does to the same request without it (parsing and re-encoding the
same JSON: the relay's own work), taking turns; and the scan of a hostile megabyte (digits and
spaces in card-like groups, the body limit: the slowest text known for the scanner), alone.

Run: .venv/bin/python -m bench.compliance_cost
Writes bench/results/compliance_cost.json.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from appliance.settings import ComplianceSettings
from serve.compliance import Compliance, Marks

RESULTS = Path(__file__).parent / "results" / "compliance_cost.json"
ROUNDS = 5
REQUESTS = 200
WORDS = ("the", "model", "answers", "with", "a", "short", "paragraph", "about", "deployment", "on", "GPUs")


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


def per_request(work: Callable[[], object]) -> float:
    """Median microseconds of one request's work over ROUNDS rounds of REQUESTS."""
    rounds = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        for _ in range(REQUESTS):
            work()
        rounds.append((time.perf_counter() - started) / REQUESTS * 1e6)
    return statistics.median(rounds)


def main() -> None:
    compliance = Compliance(ComplianceSettings())
    policy = compliance.policy(["user"])
    body = json.dumps(PROMPT).encode()
    answer = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER}}]}).encode()
    stream = events()

    def prompt_bare() -> object:
        return json.dumps(json.loads(body))

    def prompt_screened() -> object:
        payload = json.loads(body)
        compliance.screen_prompt(payload, tuple(name for name in payload if name != "model"), policy, Marks())
        return json.dumps(payload)

    def answer_bare() -> object:
        return json.dumps(json.loads(answer))

    def answer_screened() -> object:
        screen = compliance.answer_filter(policy, Marks())
        assert screen is not None
        return json.dumps(screen.answer(json.loads(answer)))

    def stream_bare() -> object:
        return [json.dumps(json.loads(event)) for event in stream]

    def stream_screened() -> object:
        screen = compliance.answer_filter(policy, Marks())
        assert screen is not None
        sent = [json.dumps(screen.event(json.loads(event))) for event in stream]
        return sent + [json.dumps(event) for event in screen.finish()]

    figures = {}
    for name, bare, screened in (("prompt", prompt_bare, prompt_screened), ("answer", answer_bare, answer_screened),
                                 ("stream", stream_bare, stream_screened)):
        bare_us, screened_us = per_request(bare), per_request(screened)
        figures[name] = {"bare_us": round(bare_us, 1), "screened_us": round(screened_us, 1),
                         "added_us": round(screened_us - bare_us, 1), "ratio": round(screened_us / bare_us, 2)}
    hostile = {"model": "m", "messages": [{"role": "user", "content": "4111 " * 200_000}]}  # 1 MB, the body limit
    scans = []
    for _ in range(3):
        started = time.perf_counter()
        compliance.screen_prompt(hostile, ("messages",), policy, Marks())
        scans.append(time.perf_counter() - started)
    result = {"prompt_chars": len(body), "answer_chars": len(ANSWER), "stream_events": len(stream),
              "requests_per_round": REQUESTS, "rounds": ROUNDS, **figures,
              "stream_added_us_per_event": round(figures["stream"]["added_us"] / len(stream), 1),
              "hostile_megabyte_prompt_ms": round(statistics.median(scans) * 1000)}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
