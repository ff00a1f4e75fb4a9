"""An input file's lines: read from the store in chunks, split into numbered lines, each checked as
a request the worker can send as it is (strict JSON, its fields, its size as sent, the choices it
asks for)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from appliance.artifacts import ArtifactStore, LocalStore
from appliance.choices import prompt_count
from appliance.errors import ArtifactStoreError
from appliance.s3_store import S3Store

CUSTOM_ID_MAX = 512
READ_BYTES = 1 << 20  # an input file is read this much at a time


class LineFault(Exception):
    """What is wrong with one line: the field (None: the line itself) and why."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


def check_line(raw: bytes, endpoint: str, max_line_bytes: int, max_choices: int | None,
               seen: Callable[[str], bool]) -> tuple[str, bytes]:
    """One line's request (custom_id, body as the worker sends it); LineFault naming the field if
    it is bad. A line must be what the worker can send as it is: strict JSON (no NaN), no lone
    surrogates, at most `max_line_bytes` (the gateway's body limit) as sent, at most `max_choices`
    choices, with a custom_id not `seen` before."""
    try:
        item = json.loads(raw, parse_constant=_no_constant)
        json.dumps(item, ensure_ascii=False, allow_nan=False).encode()  # no lone surrogate, no 1e999
    except (ValueError, UnicodeError) as exc:
        raise LineFault(None, _json_fault(exc)) from None
    except RecursionError:
        raise LineFault(None, "nested too deeply") from None
    if not isinstance(item, dict):
        raise LineFault(None, "a line must be a JSON object")
    if unknown := sorted(set(item) - {"custom_id", "method", "url", "body"}):
        raise LineFault(unknown[0][:64], f"unknown field {unknown[0][:64]!r}")
    custom_id, body = item.get("custom_id"), item.get("body")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= CUSTOM_ID_MAX:
        raise LineFault("custom_id", f"custom_id must be a string of 1 to {CUSTOM_ID_MAX} characters")
    if seen(custom_id):
        raise LineFault("custom_id", "custom_id is not unique in the file")
    if item.get("method") != "POST":
        raise LineFault("method", "method must be 'POST'")
    if item.get("url") != endpoint:
        raise LineFault("url", f"url must be the batch's endpoint, {endpoint}")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        raise LineFault("body", "body must be an object naming a model")
    if body.get("stream"):
        raise LineFault("body.stream", "a batch request cannot be streamed")
    if len(wire := wire_body(body)) > max_line_bytes:  # as the worker sends it
        raise LineFault("body", f"the body is longer than {max_line_bytes} bytes once encoded as the gateway gets it "
                     "(gateway.max_body_bytes)")
    _check_choices(body, max_choices)
    return custom_id, wire


def _check_choices(body: dict[str, Any], max_choices: int | None) -> None:
    """The engine produces prompts x n choices for a body; the owner's max_n caps them (as the
    gateway does when the request is sent, and as it does, `best_of` is refused)."""
    if "best_of" in body:
        raise LineFault("body.best_of", "best_of is not supported (the engine has none; ask for n choices)")
    n = body.get("n", 1)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise LineFault("body.n", "n must be a positive integer")
    prompts = prompt_count(body.get("prompt"))
    choices = prompts * (n or 1)
    if max_choices is not None and choices > max_choices:
        raise LineFault("body.prompt" if prompts > 1 else "body.n",
                     f"{choices} choices asked ({prompts} prompts x n {n or 1}); your role allows {max_choices} "
                     "(gateway.limits max_n)")


def split_lines(chunks: Iterable[bytes], max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """The lines of a file read in chunks, numbered from 1; only "\\n" ends one (JSON text may hold
    U+2028). A line longer than `max_line_bytes` is None, and is not kept in memory."""
    number, part, too_long = 1, bytearray(), False
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            piece = chunk[start:end]
            yield number, None if too_long or len(part) + len(piece) > max_line_bytes else bytes(part + piece)
            number, part, too_long, start = number + 1, bytearray(), False, end + 1
        rest = chunk[start:]
        too_long = too_long or len(part) + len(rest) > max_line_bytes
        part = bytearray() if too_long else part + rest
    if part or too_long:
        yield number, None if too_long else bytes(part)


# How validation reads an input file: the store and the file's key in, its bytes out in order.
Reader = Callable[[ArtifactStore, str], Iterable[bytes]]


def read_chunks(store: ArtifactStore, key: str, size: int = READ_BYTES) -> Iterator[bytes]:
    """A stored file `size` bytes at a time (ranged reads on S3; a store without them: at once)."""
    if isinstance(store, LocalStore):
        path = store.root / key
        try:
            with path.open("rb") as file:
                while chunk := file.read(size):
                    yield chunk
        except OSError as exc:
            raise ArtifactStoreError(f"cannot read {path}: {exc.strerror or exc}") from exc
    elif isinstance(store, S3Store):
        length, _ = store.size_and_etag(key)
        for offset in range(0, length, size):
            yield store.get(key, offset, min(size, length - offset))
    else:
        yield store.get(key)


def wire_body(body: dict[str, Any]) -> bytes:
    """A request's body as the batch-worker sends it to the gateway."""
    return json.dumps(body, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _json_fault(exc: ValueError | UnicodeError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"not JSON ({exc.msg} at column {exc.colno})"
    if isinstance(exc, UnicodeError):
        return "not UTF-8, or a lone surrogate"
    return f"not JSON ({exc})"
