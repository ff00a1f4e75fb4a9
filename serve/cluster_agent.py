"""A worker's `cluster-agent` (`python -m serve.cluster_agent`): every `heartbeat_s` it tells the
head the state of this host's ranks, and (re)starts them for the epoch the head answers with.

A rank is started only for an epoch: when the head starts a new one (a rank anywhere exited),
the ranks here are stopped and started again, so that every member of the pool's
torch.distributed group belongs to the same start. Nothing restarts a rank by itself.
"""

from __future__ import annotations

import logging
import time

import httpx

from appliance.cluster_client import credential, head_client
from appliance.engine_launch import engine_program
from appliance.home import Home
from appliance.hosts import Heartbeat, HeartbeatAnswer, RankReport, membership
from appliance.supervisor import LIVE_STATES, ProcessInfo, Supervisor

log = logging.getLogger("appliance.cluster-agent")


def run(home: Home) -> None:
    joined = membership(home)
    if joined is None:
        raise SystemExit(f"{home.root} has not joined a cluster")
    supervisor = Supervisor(home)
    started: dict[str, int] = {rank.pool: 0 for rank in joined.ranks}  # the epoch each rank was started for
    with head_client(home, joined.head_url, joined.name, credential(home), timeout=5) as client:
        while True:
            processes = {info.name: info for info in supervisor.processes()}
            reports = []
            for pool, epoch in started.items():
                info = processes.get(engine_program(pool))
                pid = info.pid if info is not None and info.state in LIVE_STATES else 0
                reports.append(RankReport(pool=pool, epoch=epoch, running=pid > 0, pid=pid))
            try:
                response = client.post("/cluster/heartbeat", json=Heartbeat(ranks=reports).model_dump())
                if response.status_code == 401:
                    log.error("the head refused this host's credential (removed?): stopping its ranks")
                    for pool in started:
                        _stop(supervisor, engine_program(pool), processes)
                    started = dict.fromkeys(started, 0)
                    time.sleep(5)
                    continue
                response.raise_for_status()
                answer = HeartbeatAnswer.model_validate(response.json())
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("heartbeat to %s failed: %s", joined.head_url, exc)
                time.sleep(joined.heartbeat_s)
                continue
            for pool, epoch in answer.epochs.items():
                if pool in started and started[pool] != epoch:
                    program = engine_program(pool)
                    _stop(supervisor, program, processes)
                    supervisor.call("startProcess", program, False)
                    started[pool] = epoch
                    log.warning("started %s for epoch %d", program, epoch)
            time.sleep(joined.heartbeat_s)


def _stop(supervisor: Supervisor, program: str, processes: dict[str, ProcessInfo]) -> None:
    info = processes.get(program)
    if info is not None and info.state in LIVE_STATES:
        supervisor.call("stopProcess", program, True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    run(Home.from_env())
