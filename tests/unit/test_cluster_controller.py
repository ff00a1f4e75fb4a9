"""The controller of pools spanning hosts (serve.cluster_controller), driven step by step with a
stand-in for supervisord; the real thing runs in tests/integration/test_cluster.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.home import Home
from appliance.hosts import Heartbeat, RankReport, cluster_state_file
from appliance.settings import Settings
from appliance.supervisor import ProcessInfo, ProcessState
from audit.records import AuditEvent
from serve.cluster_controller import Controller
from tests.support.plans import plan_file

pytestmark = pytest.mark.integration  # the fixture writes its plan with the real `appliance plan`


class FakeSupervisor:
    """The head's supervisord as far as the controller sees it: one engine program."""

    def __init__(self) -> None:
        self.state, self.pid, self.next_pid, self.calls = ProcessState.STOPPED, 0, 100, []

    def processes(self) -> list[ProcessInfo]:
        return [ProcessInfo("vllm-big", self.state, self.pid, 0, Path("/dev/null"), "")]

    def call(self, method: str, *args: object) -> None:
        self.calls.append(method)
        if method == "startProcess":
            self.state, self.pid, self.next_pid = ProcessState.STARTING, self.next_pid, self.next_pid + 1
        elif method == "stopProcess":
            self.state, self.pid = ProcessState.STOPPED, 0


@pytest.fixture
def controlled(tmp_path: Path, home: Home,
               monkeypatch: pytest.MonkeyPatch) -> tuple[Controller, FakeSupervisor, list[AuditEvent]]:
    plan = plan_file(home.root, "llama-3.1-405b", "2x8xH100-80GB")
    settings = Settings.model_validate({"engine": {"device": "cuda"}, "cluster": {"bind": "10.9.0.1"},
                                        "pools": [{"name": "big", "model": str(tmp_path / "M"), "plan": str(plan)}]})
    audited: list[AuditEvent] = []
    controller = Controller(settings, home, audited.append)
    fake = FakeSupervisor()
    controller.supervisor = fake  # type: ignore[assignment]
    monkeypatch.setattr(controller, "_engine_answers", lambda pool: fake.state == ProcessState.RUNNING)
    return controller, fake, audited


def beat(controller: Controller, epoch: int, pid: int, running: bool = True) -> int:
    worker = controller.pools["big"].span.workers[0]
    answer = controller.heartbeat(worker, Heartbeat(ranks=[RankReport(pool="big", epoch=epoch, running=running,
                                                                      pid=pid)]))
    return answer.epochs["big"]


def state(controller: Controller) -> dict:
    return json.loads(cluster_state_file(controller.home, "big").read_text())


def test_the_head_starts_once_every_worker_joined_the_epoch_and_a_lost_rank_restarts_all(controlled) -> None:
    controller, fake, audited = controlled
    controller.tick()
    assert fake.calls == [] and state(controller)["why"].startswith("waiting for")
    assert beat(controller, 0, 0, running=False) == 1  # the agent learns the epoch, starts its rank
    assert beat(controller, 1, 7) == 1
    controller.tick()
    assert fake.calls == ["startProcess"] and not state(controller)["ready"]
    fake.state = ProcessState.RUNNING
    controller.tick()
    assert state(controller)["ready"] and state(controller)["why"] == "serving"
    # The worker's rank dies: unready at once, a new epoch, the head's rank stopped, audited.
    assert beat(controller, 1, 7, running=False) == 2
    assert not state(controller)["ready"] and state(controller)["epoch"] == 2
    assert [e.action for e in audited] == ["cluster.restart"] and "the rank on" in (audited[0].error or "")
    controller.tick()
    assert fake.calls == ["startProcess", "stopProcess"]
    # A second report of the same pool in one heartbeat does not start more epochs.
    worker = controller.pools["big"].span.workers[0]
    controller.heartbeat(worker, Heartbeat(ranks=[RankReport(pool="big", epoch=2, running=True, pid=8),
                                                  RankReport(pool="big", epoch=2, running=False, pid=0)]))
    assert state(controller)["epoch"] == 2 and len(audited) == 1


def test_no_epoch_fails_for_a_worker_that_never_joined_it(controlled) -> None:
    controller, fake, audited = controlled
    for _ in range(3):
        controller.tick()
    assert audited == [] and state(controller)["epoch"] == 1 and fake.calls == []


def test_failed_epochs_back_off(controlled) -> None:
    controller, fake, audited = controlled
    beat(controller, 1, 7)
    controller.tick()
    fake.state = ProcessState.RUNNING
    controller.tick()
    beat(controller, 1, 7, running=False)  # epoch 2
    beat(controller, 2, 8)
    controller.tick()  # stops the head; its next start waits 1 s
    controller.tick()
    assert fake.calls == ["startProcess", "stopProcess"] and "restarting in" in state(controller)["why"]
