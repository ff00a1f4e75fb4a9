"""The engines' own metrics, relayed: each replica's vLLM /metrics (queue length, KV-cache use,
prefix-cache hits, time per output token...), fetched over its Unix socket (engines listen on no
TCP port) and labelled with its pool, replica and tier, all in one exposition that the appliance's
Prometheus scrapes at the gateway's /metrics/engines with the monitoring password.
`appliance_engine_scrape_up` says which replicas answered, so a silent engine shows as 0 instead
of as missing series.

An engine's answer is not trusted: only its `vllm:` families pass (an engine cannot pose as the
gateway's metrics and forge or hide the gateway's alerts), not its `_info` families (its
configuration as dozens of labels, model paths among them, and the LoRA adapters in use, which
/v1/models hides by role), without timestamps or exemplars, each label value shown-safe and
at most LABEL_VALUE_MAX characters; an answer over MAX_BYTES, or one that does not parse, counts as
no answer. One relay runs at a time, its result kept for REUSE_S, so a flood of scrapes costs the
engines one scrape a second, and the parsing runs off the event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Mapping

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from appliance.terminal import UNSAFE
from serve.engine import ENGINE_BASE_URL
from serve.replicas import Pool, Replica

SCRAPE_TIMEOUT_S = 5.0
MAX_BYTES = 16 << 20  # a replica's exposition; vLLM's is tens of kilobytes
LABEL_VALUE_MAX = 200
REUSE_S = 1.0
OWN_LABELS = ("pool", "replica", "tier")  # set here: an engine's own label of the same name is replaced


class _Families:
    """What generate_latest reads: metric families, once."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


async def _fetch(session: aiohttp.ClientSession, headers: Mapping[str, str]) -> str | None:
    """A replica's exposition, as UTF-8 whatever charset it claims; None if it did not give one."""
    body = bytearray()
    try:
        async with session.get(f"{ENGINE_BASE_URL}/metrics", headers=headers, raise_for_status=True,
                               timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as response:
            async for chunk in response.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > MAX_BYTES:
                    return None
    except Exception:  # whatever a replica does wrong, it is that replica down, never the whole relay
        return None
    return body.decode("utf-8", errors="replace")


def _safe(sample: Sample, where: dict[str, str]) -> Sample:
    labels = {name: UNSAFE.sub("\ufffd", value)[:LABEL_VALUE_MAX] for name, value in sample.labels.items()}
    return sample._replace(labels={**labels, **where}, timestamp=None, exemplar=None)


def relabelled(answers: Iterable[tuple[Pool, Replica, str | None]]) -> bytes:
    """One exposition of every replica's metrics, each sample labelled with where it came from."""
    up = GaugeMetricFamily("appliance_engine_scrape_up", "Whether an engine replica answered the relay's "
                           "scrape of its metrics (1) or not (0).", labels=list(OWN_LABELS))
    families: dict[str, Metric] = {}
    for pool, replica, text in answers:
        where = {"pool": pool.name, "replica": replica.name, "tier": pool.tier or ""}
        parsed: list[Metric] = []
        if text is not None:
            try:
                parsed = list(text_string_to_metric_families(text))
            except Exception:  # the parser's errors are many (ValueError, IndexError...): no answer
                text = None
        up.add_metric(list(where.values()), 0.0 if text is None else 1.0)
        for family in parsed:
            if not family.name.startswith("vllm:") or family.name.endswith("_info"):
                continue
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                              family.unit))
            if merged.type != family.type:
                continue  # two engines disagree on a metric's type: the first one's stands
            merged.samples.extend(_safe(sample, where) for sample in family.samples)
    return generate_latest(_Families([up, *families.values()]))


class EngineMetricsRelay:
    """The relay over a gateway's pools: one scrape of the engines at a time, reused for REUSE_S."""

    def __init__(self, pools: Iterable[Pool], sessions: Mapping[str, aiohttp.ClientSession],
                 headers: Mapping[str, str]) -> None:
        self._replicas = [(pool, replica) for pool in pools for replica in pool.replicas]
        self._sessions, self._headers = sessions, headers
        self._lock = asyncio.Lock()
        self._last: tuple[float, bytes] | None = None

    async def exposition(self) -> bytes:
        async with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] < REUSE_S:
                return self._last[1]
            texts = await asyncio.gather(*(_fetch(self._sessions[replica.name], self._headers)
                                           for _, replica in self._replicas))
            answers = [(pool, replica, text) for (pool, replica), text in zip(self._replicas, texts, strict=True)]
            body = await asyncio.to_thread(relabelled, answers)
            self._last = (time.monotonic(), body)
            return body
