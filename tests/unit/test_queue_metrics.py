"""The work queues in the gateway's /metrics: depth, held items and the oldest item's wait."""

from __future__ import annotations

import sqlite3
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from appliance import batches, jobs
from appliance.home import Home
from appliance.jobs import Hyperparameters
from appliance.rl import executions, runs
from appliance.rl.tasks import Task
from appliance.work_queues import WORK_QUEUES
from finetune.rl.store import RunStore
from serve.metrics import QueueCollector, Reused, wait_quantiles


def scraped(home: Home) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry()
    registry.register(QueueCollector(home))
    return {(sample.name, sample.labels["queue"]): sample.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for sample in family.samples}


def submit_job(home: Home, name: str, waited_s: float) -> int:
    job = jobs.submit(home, name=name, data="d", base="demo", hyperparameters=Hyperparameters(), eval_sets={})
    submitted = (datetime.now(UTC) - timedelta(seconds=waited_s)).isoformat(timespec="seconds")
    with jobs.transaction(home) as db:
        db.execute("update jobs set submitted = ? where id = ?", (submitted, job.id))
    return job.id


def test_each_queue_reports_waiting_held_and_the_oldest_wait(home: Home) -> None:
    submit_job(home, "a", waited_s=600)
    submit_job(home, "b", waited_s=90)
    submit_job(home, "c", waited_s=30)
    jobs.claim(home, 4242, alive=lambda pid: True)  # the oldest, "a", runs now
    with batches.connect(home) as db:
        db.execute("insert into batches (id, owner, username, roles, endpoint, input_file_id, completion_window, "
                   "status, created_at, expires_at) values ('b1', 'o', 'u', '[]', '/v1/chat/completions', 'f', "
                   "'24h', 'in_progress', ?, ?)", (int(time.time()) - 300, int(time.time()) + 86400))
        db.executemany("insert into batch_requests (batch_id, line, custom_id, body, state) values "
                       "('b1', ?, ?, '{}', 'pending')", [(n, f"r{n}") for n in (1, 2)])
    figures = scraped(home)
    assert figures[("appliance_queue_recent_claims", "finetune_jobs")] == 1  # "a", after 600 s
    assert 595 <= figures[("appliance_queue_wait_seconds", "finetune_jobs")] < 630
    assert figures[("appliance_queue_recent_claims", "rl_runs")] == 0
    assert ("appliance_queue_wait_seconds", "rl_runs") not in figures  # none claimed: no made-up wait
    assert figures[("appliance_queue_waiting", "finetune_jobs")] == 2
    assert figures[("appliance_queue_held", "finetune_jobs")] == 1
    assert 85 <= figures[("appliance_queue_oldest_waiting_seconds", "finetune_jobs")] < 120  # "b", not "a"
    assert figures[("appliance_queue_waiting", "batch_requests")] == 2
    assert 295 <= figures[("appliance_queue_oldest_waiting_seconds", "batch_requests")] < 330
    assert figures[("appliance_queue_waiting", "rl_runs")] == 0
    assert figures[("appliance_queue_oldest_waiting_seconds", "rl_runs")] == 0  # none waits
    readable = {queue for (name, queue), value in figures.items() if name == "appliance_queue_readable" and value}
    assert readable == {work.name for work in WORK_QUEUES} | {"rl_executions"}


def test_rl_executions_are_counted_over_every_running_run(home: Home) -> None:
    """Each RL run keeps its executions in its own database; the running runs' count together."""
    task = Task(id="t", prompt="p", language="python", tests="assert True")
    spec = runs.RunSpec(tasks="set", base="demo")
    first, second, queued = runs.submit(home, spec), runs.submit(home, spec), runs.submit(home, spec)
    for _ in (first, second):
        assert runs.claim(home, 4242, alive=lambda pid: True) is not None
    for run in (first, second, queued):
        runs.run_dir(home, run.id).mkdir(parents=True)
    stores = {run.id: RunStore(executions.store_path(home, run.id)) for run in (first, second, queued)}
    for key in ("a", "b", "c"):
        stores[first.id].enqueue(key, "print(1)", task)
    stores[second.id].enqueue("d", "print(1)", task)
    stores[queued.id].enqueue("e", "print(1)", task)  # its run waits: its executions are not counted
    assert stores[first.id].claim(777) is not None  # "a" runs
    with sqlite3.connect(executions.store_path(home, second.id)) as db:
        db.execute("update executions set queued_at = queued_at - 200 where key = 'd'")
    for store in stores.values():
        store.close()
    figures = scraped(home)
    assert figures[("appliance_queue_readable", "rl_executions")] == 1
    assert figures[("appliance_queue_waiting", "rl_executions")] == 3  # b, c and d
    assert figures[("appliance_queue_held", "rl_executions")] == 1
    assert 199 <= figures[("appliance_queue_oldest_waiting_seconds", "rl_executions")] < 230
    assert figures[("appliance_queue_recent_claims", "rl_executions")] == 1  # "a", at once


def test_wait_quantiles_are_nearest_rank_and_none_without_claims() -> None:
    assert wait_quantiles(()) == {}
    assert wait_quantiles((5.0,)) == {"0.5": 5.0, "0.95": 5.0, "1": 5.0}
    assert wait_quantiles(tuple(float(n) for n in range(100, 0, -1))) == {"0.5": 50.0, "0.95": 95.0, "1": 100.0}


def test_an_unreadable_queue_says_so_and_invents_no_figures(home: Home) -> None:
    jobs.database(home).parent.mkdir(parents=True, exist_ok=True)
    jobs.database(home).mkdir()  # a directory where the database should be
    figures = scraped(home)
    for queue in ("finetune_jobs", "rl_runs", "rl_exports", "rl_executions"):
        assert figures[("appliance_queue_readable", queue)] == 0
        assert ("appliance_queue_waiting", queue) not in figures
    assert figures[("appliance_queue_readable", "batch_requests")] == 1


def test_a_flood_of_scrapes_reads_the_queues_once_a_period(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    collector = QueueCollector(home)
    real = collector.collect
    monkeypatch.setattr(collector, "collect", lambda: (reads.append(1), real())[1])
    registry = CollectorRegistry()
    registry.register(Reused(collector, reuse_s=60))
    bodies = {generate_latest(registry) for _ in range(50)}
    assert len(reads) == 1 and len(bodies) == 1 and b"appliance_queue_waiting" in next(iter(bodies))


@pytest.mark.parametrize("planted", ["link", "garbage", "directory"])
def test_a_run_whose_database_cannot_be_read_is_left_out_not_the_queue(home: Home, tmp_path: Path,
                                                                        planted: str) -> None:
    task = Task(id="t", prompt="p", language="python", tests="assert True")
    spec = runs.RunSpec(tasks="set", base="demo")
    good, bad = runs.submit(home, spec), runs.submit(home, spec)
    for run in (good, bad):
        assert runs.claim(home, 4242, alive=lambda pid: True) is not None
        runs.run_dir(home, run.id).mkdir(parents=True)
    store = RunStore(executions.store_path(home, good.id))
    store.enqueue("a", "print(1)", task)
    store.close()
    path = executions.store_path(home, bad.id)
    if planted == "link":  # to another run's database: never followed
        path.symlink_to(executions.store_path(home, good.id))
    elif planted == "garbage":
        path.write_bytes(b"not a database" * 100)
    else:
        path.mkdir()
    figures = scraped(home)
    assert figures[("appliance_queue_readable", "rl_executions")] == 1
    assert figures[("appliance_queue_waiting", "rl_executions")] == 1  # the good run's, counted once
