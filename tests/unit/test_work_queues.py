"""The one way a queue worker takes an item, does it and tells the audit log how it ended
(appliance.work_queues.ItemWork), and that every worker's items go through it."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from appliance import jobs
from appliance.home import Home
from appliance.jobs import Hyperparameters, JobState
from appliance.settings import Settings
from appliance.work_queues import ItemWork, serve_worker
from audit import read_records
from finetune.rl.worker import Exports, Runs
from finetune.worker import Jobs


@dataclass(frozen=True)
class Thing:
    id: int
    state: JobState
    message: str | None = None


class Things(ItemWork[Thing]):
    """Items from a list; `taken_over`: finish says another worker ended it."""

    action = "test.thing"
    target_kind = "thing"
    actor = "test-worker"

    def __init__(self, home: Home, waiting: list[Thing], outcome: tuple[JobState, str],
                 taken_over: bool = False) -> None:
        super().__init__(home, Settings(), logging.getLogger("test-worker"))
        self.waiting, self.outcome, self.taken_over = waiting, outcome, taken_over
        self.done: list[int] = []
        self.ended: dict[int, Thing] = {}

    def claim(self) -> Thing | None:
        return self.waiting.pop(0) if self.waiting else None

    def work(self, item: Thing) -> tuple[JobState, str]:
        self.done.append(item.id)
        return self.outcome

    def finish(self, item: Thing, state: JobState, message: str) -> bool:
        if self.taken_over:
            return False
        self.ended[item.id] = replace(item, state=state, message=message)
        return True

    def get(self, item: Thing) -> Thing:
        return self.ended.get(item.id, item)

    def describe(self, item: Thing) -> str:
        return f"thing {item.id}"


@pytest.fixture
def audited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Home:
    home = Home(tmp_path / "h").ensure()
    monkeypatch.setenv("APPLIANCE_HOME", str(home.root))
    return home


def ends(home: Home) -> list[tuple[str, str, str, str]]:
    return [(r["action"], r["outcome"], r["target"]["name"], r["username"]) for r in read_records(home.audit)
            if r["action"] == "test.thing"]


def test_an_item_is_done_ended_and_its_end_told_once(audited: Home) -> None:
    things = Things(audited, [Thing(1, JobState.RUNNING)], (JobState.SUCCEEDED, "made"))
    assert things.take_one() == Thing(1, JobState.SUCCEEDED, "made")
    assert things.take_one() is None, "nothing left: None"
    assert things.done == [1] and ends(audited) == [("test.thing", "allowed", "1", "test-worker")]


def test_an_item_the_queue_gave_up_is_told_as_found_and_not_done(audited: Home) -> None:
    given_up = Thing(2, JobState.FAILED, "the worker died 3 times")
    things = Things(audited, [given_up], (JobState.SUCCEEDED, "made"))
    assert things.take_one() == given_up and things.done == []
    [record] = [r for r in read_records(audited.audit) if r["action"] == "test.thing"]
    assert record["outcome"] == "error" and "thing 2 failed: the worker died 3 times" in record["error"]


def test_an_item_another_worker_ended_keeps_their_outcome(audited: Home, caplog: pytest.LogCaptureFixture) -> None:
    things = Things(audited, [Thing(3, JobState.RUNNING)], (JobState.FAILED, "late"), taken_over=True)
    assert things.take_one() == Thing(3, JobState.RUNNING)
    assert ends(audited) == [] and "thing 3 had already ended or was taken over" in caplog.text


def test_every_one_at_a_time_worker_takes_its_items_the_one_way() -> None:
    # Each fills in only claim, work, finish, get and describe: none takes or announces on its own.
    for work in (Jobs, Exports, Runs):
        assert issubclass(work, ItemWork) and "take_one" not in vars(work) and "announce" not in vars(work)
    assert (Jobs.action, Exports.action, Runs.action) == ("finetune.job", "rl.export", "rl.run")


def test_a_worker_stopped_as_asked_hands_back_what_it_held(audited: Home) -> None:
    job = jobs.submit(audited, name="j", data="d", base="b", hyperparameters=Hyperparameters(), eval_sets={})
    claimed = jobs.claim(audited, os.getpid(), lambda pid: pid == os.getpid())
    assert claimed is not None and claimed.attempts == 1

    def stopped(home: Home, settings: Settings) -> None:
        raise SystemExit(0)  # what SIGTERM does in the worker

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            serve_worker("finetune-worker", stopped)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert jobs.get(audited, job.id).attempts == 0, "a stop asked for is not a death"
