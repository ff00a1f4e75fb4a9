"""Relaying an engine's SSE stream: bytes pass through unchanged, and usage is reported once,
before the end marker goes on (running totals or not, cut short or not)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from serve.upstream import relay_stream


def event(text: str | None = None, usage: tuple[int, int] | None = None) -> bytes:
    body: dict = {"choices": [{"index": 0, "delta": {"content": text}}] if text else []}
    if usage:
        body["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Engine:
    """Stands in for aiohttp's response: its body arrives in the given chunks."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.content = self
        self.ended = ""

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk

    def release(self) -> None:
        self.ended = "released"

    def close(self) -> None:
        self.ended = "closed"


def relay(engine: Engine, take: int | None = None) -> tuple[list[bytes], list[tuple], list[str]]:
    """What the client got, the usage reports (with how many chunks had gone on before each),
    and the texts seen; `take` chunks only when the client leaves early."""
    got: list[bytes] = []
    reports: list[tuple] = []
    texts: list[str] = []

    async def run() -> None:
        stream = relay_stream(engine, lambda: None, lambda p, c: reports.append((p, c, len(got))), texts.append)
        async for chunk in stream:
            got.append(chunk)
            if take is not None and len(got) == take:
                await stream.aclose()
                return

    asyncio.run(run())
    return got, reports, texts


def test_bytes_pass_through_and_usage_is_reported_before_the_end_marker() -> None:
    chunks = [event("O"), event("K"), event(usage=(10, 2)) + b"data: [DONE]\n\n"]
    got, reports, texts = relay(Engine(chunks))
    assert got == chunks and texts == ["O", "K"]
    assert reports == [(10, 2, 2)], "reported before the chunk with [DONE] went on"


def test_running_totals_are_reported_once_with_the_last_total() -> None:
    chunks = [event("O", usage=(10, 1)), event("K", usage=(10, 2)), event(usage=(10, 2)), b"data: [DONE]\n\n"]
    engine = Engine(chunks)
    _, reports, _ = relay(engine)
    assert reports == [(10, 2, 3)] and engine.ended == "released"


def test_a_stream_cut_short_reports_its_text_chunks_and_drops_the_connection() -> None:
    engine = Engine([event("O"), event("K"), event("!"), event(usage=(10, 3)), b"data: [DONE]\n\n"])
    got, reports, _ = relay(engine, take=2)
    assert len(got) == 2 and reports == [(0, 2, 2)]
    assert engine.ended == "closed", "closing the upstream connection makes vLLM abort the request"


def test_an_event_split_across_reads_is_still_seen() -> None:
    whole = event("OK", usage=(4, 1)) + b"data: [DONE]\n\n"
    got, reports, texts = relay(Engine([whole[:7], whole[7:30], whole[30:]]))
    assert b"".join(got) == whole and texts == ["OK"] and reports[0][:2] == (4, 1)
