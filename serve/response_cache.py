"""The gateway's exact-match response cache, for deterministic requests.

A request is cacheable when its answer is a function of the request: temperature 0 or a fixed
seed. Its key covers everything that shapes the answer: the route, the pool (the tier) and model or
adapter version it went to, every field of the body as the engine got it (the prompt after
compliance redaction, all sampling fields, streamed or not), and who may share it: the user
(`cache.scope = "user"`, the default: never across tenants) or users holding the same roles
(`"role"`, whose compliance policy is then the same too).

An entry is the answer exactly as its client got it (a streamed one as its SSE chunks, replayed
to a streaming client), kept only once the request's audit record is written: a hit's record
names that record's sequence number. Entries live `ttl_s`, within `max_entries` and `max_bytes`
(least recently used dropped first); a deploy, canary or rollback of an adapter drops the answers
given under its name. `Cache-Control: no-cache` skips the lookup (the fresh answer is kept),
`no-store` the cache altogether.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from appliance.settings import CacheSettings
from serve.metrics import Metrics

Outcome = Literal["hit", "miss", "bypass"]


@dataclass(frozen=True)
class CachedAnswer:
    """An answer as its client got it, and what its audit record said of it."""

    chunks: tuple[bytes, ...]  # one JSON document, or a stream's SSE chunks
    stream: bool
    media_type: str
    seq: int  # the audit record of the request that produced it
    model: str  # what the client asked for: changes to an adapter's name drop its answers
    answer_marks: tuple[tuple[str, str], ...]  # what compliance filtering did to the answer
    expires: float

    @property
    def size(self) -> int:
        return sum(map(len, self.chunks))


class CacheStats(BaseModel):
    enabled: bool
    scope: str
    entries: int
    bytes: int
    max_entries: int
    max_bytes: int
    ttl_s: float
    hits: int
    misses: int
    bypasses: int
    hit_rate: float | None  # hits over lookups (hits + misses) since the gateway started


class Capture(list[bytes]):
    """The chunks of a stream as its client gets them, kept for the cache up to `limit` bytes (past
    it, none: the answer is too large to keep)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.size = 0
        self.overflowed = False

    def append(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            self.overflowed = True
            self.clear()
        elif not self.overflowed:
            super().append(chunk)


def deterministic(payload: dict[str, Any]) -> bool:
    """Whether the engine's answer is a function of the request: greedy, or seeded."""
    return payload.get("temperature") == 0 or payload.get("seed") is not None


def wants(cache_control: str | None) -> tuple[bool, bool]:
    """(look up, store) as a request's Cache-Control header allows."""
    directives = {part.strip().split("=", 1)[0].lower() for part in (cache_control or "").split(",")}
    if "no-store" in directives:
        return False, False
    return "no-cache" not in directives, True


class ResponseCache:
    def __init__(self, settings: CacheSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._entries: OrderedDict[str, CachedAnswer] = OrderedDict()  # least recently used first
        self._bytes = 0
        self.counts = {"hit": 0, "miss": 0, "bypass": 0}

    def key(self, *, subject: str, roles: frozenset[str], path: str, pool: str, payload: dict[str, Any]) -> str:
        """The key of a request: who may share its answer, where it went and everything it asked."""
        # The roles in both scopes: compliance policies differ by role, and roles change.
        sharer = [subject if self.settings.scope == "user" else None, sorted(roles)]
        canonical = json.dumps([sharer, path, pool, payload], sort_keys=True, separators=(",", ":"),
                               ensure_ascii=True)  # lone surrogates too
        return hashlib.sha256(canonical.encode()).hexdigest()

    def count(self, outcome: Outcome) -> None:
        self.counts[outcome] += 1
        self.metrics.cache.labels(outcome).inc()

    def get(self, key: str) -> CachedAnswer | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires <= time.monotonic():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: str, entry: CachedAnswer) -> bool:
        """Keep `entry` unless it is larger than an entry may be; older entries make room."""
        if entry.size > min(self.settings.max_entry_bytes, self.settings.max_bytes):
            return False
        if key in self._entries:
            self._drop(key)
        self._entries[key] = entry
        self._bytes += entry.size
        while len(self._entries) > self.settings.max_entries or self._bytes > self.settings.max_bytes:
            self._drop(next(iter(self._entries)))
        self._gauges()
        return True

    def expires(self) -> float:
        return time.monotonic() + self.settings.ttl_s

    def invalidate(self, model: str) -> int:
        """Drop the answers given for `model` (an adapter's name whose serving changed)."""
        dropped = [key for key, entry in self._entries.items() if entry.model == model]
        for key in dropped:
            self._drop(key)
        self._gauges()
        return len(dropped)

    def flush(self) -> int:
        """Drop every entry; how many there were."""
        flushed = len(self._entries)
        self._entries.clear()
        self._bytes = 0
        self._gauges()
        return flushed

    def stats(self) -> CacheStats:
        lookups = self.counts["hit"] + self.counts["miss"]
        return CacheStats(enabled=self.settings.enabled, scope=self.settings.scope, entries=len(self._entries),
                          bytes=self._bytes, max_entries=self.settings.max_entries, max_bytes=self.settings.max_bytes,
                          ttl_s=self.settings.ttl_s, hits=self.counts["hit"], misses=self.counts["miss"],
                          bypasses=self.counts["bypass"],
                          hit_rate=round(self.counts["hit"] / lookups, 4) if lookups else None)

    def _drop(self, key: str) -> None:
        self._bytes -= self._entries.pop(key).size

    def _gauges(self) -> None:
        self.metrics.cache_entries.set(len(self._entries))
        self.metrics.cache_bytes.set(self._bytes)
