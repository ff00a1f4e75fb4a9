"""The engines' own metrics, relayed: each replica's vLLM /metrics (queue length, KV-cache use,
prefix-cache hits, time per output token...), fetched over its Unix socket (engines listen on no
TCP port) and labelled with its pool, replica and tier, all in one exposition that Prometheus
scrapes at the gateway's /metrics/engines. `appliance_engine_scrape_up` says which replicas
answered, so a silent engine shows as 0 instead of as missing series."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from serve.engine import ENGINE_BASE_URL
from serve.replicas import Pool, Replica

SCRAPE_TIMEOUT_S = 5.0
OWN_LABELS = ("pool", "replica", "tier")  # set here: an engine's own label of the same name is replaced


class _Families:
    """What generate_latest reads: metric families, once."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


async def _fetch(session: aiohttp.ClientSession, headers: Mapping[str, str]) -> str | None:
    try:
        async with session.get(f"{ENGINE_BASE_URL}/metrics", headers=headers, raise_for_status=True,
                               timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as response:
            return await response.text()
    except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
        return None


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
            except ValueError:
                text = None  # an exposition that does not parse counts as no answer
        up.add_metric(list(where.values()), 0.0 if text is None else 1.0)
        for family in parsed:
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                              family.unit))
            if merged.type != family.type:
                continue  # two engines disagree on a metric's type: the first one's stands
            merged.samples.extend(sample._replace(labels={**sample.labels, **where}) for sample in family.samples)
    return generate_latest(_Families([up, *families.values()]))


async def engine_metrics(pools: Iterable[Pool], sessions: Mapping[str, aiohttp.ClientSession],
                         headers: Mapping[str, str]) -> bytes:
    """Every replica of every pool scraped at once, relabelled (see `relabelled`)."""
    replicas = [(pool, replica) for pool in pools for replica in pool.replicas]
    texts = await asyncio.gather(*(_fetch(sessions[replica.name], headers) for _, replica in replicas))
    return relabelled((pool, replica, text) for (pool, replica), text in zip(replicas, texts, strict=True))
