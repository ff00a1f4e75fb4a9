"""The response cache's rules: deterministic requests only, keys by scope and content,
TTL, bounds, invalidation by model name, Cache-Control."""

from __future__ import annotations

import time

from appliance.settings import CacheSettings
from serve.metrics import Metrics
from serve.response_cache import CachedAnswer, Capture, ResponseCache, deterministic, wants

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def entry(cache: ResponseCache, size: int = 10, model: str = "m", seq: int = 1) -> CachedAnswer:
    return CachedAnswer((b"x" * size,), False, "application/json", seq, model, (), cache.expires())


def key(cache: ResponseCache, subject: str = "alice", roles: frozenset[str] = frozenset({"user"}), **body: object
        ) -> str:
    return cache.key(subject=subject, roles=roles, path="/v1/chat/completions", pool="main", payload={**BODY, **body})


def test_only_greedy_or_seeded_requests_are_cacheable() -> None:
    assert deterministic({"temperature": 0}) and deterministic({"temperature": 0.0})
    assert deterministic({"temperature": 0.9, "seed": 7})
    assert not deterministic({}) and not deterministic({"temperature": 0.2})


def test_cache_control_skips_the_lookup_or_the_cache() -> None:
    assert wants(None) == (True, True)
    assert wants("no-cache") == (False, True)
    assert wants("max-age=0, No-Store") == (False, False)


def test_keys_separate_users_roles_fields_and_pools() -> None:
    cache = ResponseCache(CacheSettings(), Metrics())
    assert key(cache) == key(cache)
    assert key(cache) != key(cache, subject="bob")  # per user by default: never across tenants
    assert key(cache) != key(cache, max_tokens=5) != key(cache, stream=True)
    assert key(cache) != cache.key(subject="alice", roles=frozenset({"user"}), path="/v1/chat/completions",
                                   pool="fast", payload=BODY)
    shared = ResponseCache(CacheSettings(scope="role"), Metrics())
    assert key(shared) == key(shared, subject="bob")
    assert key(shared) != key(shared, roles=frozenset({"user", "auditor"}))
    assert key(cache, messages=[{"role": "user", "content": "\ud800"}])  # a lone surrogate keys too


def test_entries_expire_and_stay_within_their_bounds() -> None:
    cache = ResponseCache(CacheSettings(max_entries=3, max_bytes=2048, max_entry_bytes=1024, ttl_s=0.05), Metrics())
    assert cache.put("a", entry(cache)) and cache.get("a") is not None
    time.sleep(0.06)
    assert cache.get("a") is None and cache.stats().entries == 0
    cache = ResponseCache(CacheSettings(max_entries=3, max_bytes=2048, max_entry_bytes=1024), Metrics())
    assert not cache.put("huge", entry(cache, size=1025))
    for name in "abcd":
        cache.put(name, entry(cache))
    assert cache.get("a") is None and cache.stats().entries == 3  # least recently used dropped
    cache.get("b")
    cache.put("big1", entry(cache, size=1000))
    cache.put("big2", entry(cache, size=1000))
    stats = cache.stats()
    assert stats.bytes <= 2048 and cache.get("big2") is not None and cache.get("c") is None


def test_a_change_to_a_model_drops_its_answers_and_flush_drops_all() -> None:
    cache = ResponseCache(CacheSettings(), Metrics())
    cache.put("a", entry(cache, model="codes"))
    cache.put("b", entry(cache, model="base"))
    assert cache.invalidate("codes") == 1 and cache.get("a") is None and cache.get("b") is not None
    assert cache.flush() == 1 and cache.stats().entries == 0 and cache.stats().bytes == 0
    cache.count("hit")
    cache.count("miss")
    cache.count("bypass")
    assert cache.stats().hit_rate == 0.5


def test_a_stream_too_large_to_keep_is_not_collected() -> None:
    capture = Capture(10)
    capture.append(b"12345")
    capture.append(b"6789")
    assert list(capture) == [b"12345", b"6789"] and not capture.overflowed
    capture.append(b"abc")  # past the limit: nothing kept from here on
    capture.append(b"d")
    assert list(capture) == [] and capture.overflowed
