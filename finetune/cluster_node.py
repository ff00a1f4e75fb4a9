"""A worker host's `training-node` (`python -m finetune.cluster_node`): this host's part of the
training jobs over several hosts that the head publishes for it (appliance.training_launches).

For each launch it fetches the job's files and the base model from the head (each file's SHA-256
checked; files already here and correct are not fetched again), brings up its namespace of the
job's network (finetune.training_network), and runs its torchrun agent in the training sandbox
inside it; it reports each part's state to the head, stops the agent of a launch the head
withdrew (the job ended, was cancelled, or failed on another host), and takes the network down.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import time
from contextlib import ExitStack
from ipaddress import IPv4Network
from pathlib import Path

import httpx
from pydantic import TypeAdapter, ValidationError

from appliance.cluster_client import credential, head_client
from appliance.digest import sha256_file
from appliance.engine_launch import python
from appliance.errors import ApplianceError
from appliance.home import HOME_ENV, Home
from appliance.hosts import WeightFile, membership
from appliance.jobs import HostPart, read_ranks
from appliance.programs import Program
from appliance.settings import Settings, load_settings
from appliance.training_launches import TrainingLaunch
from finetune.runner import end_group, multihost_trainer_command
from finetune.sandbox import TRAINER_ENVIRONMENT, prepare, sandboxed
from finetune.train import TrainingError, TrainingSpec
from finetune.training_network import JobNetwork, job_network

log = logging.getLogger("appliance.training-node")
JOB_FILES = ("train.jsonl", "eval.jsonl", "job.json")
POLL_S = 1.0
LAUNCHES = TypeAdapter(list[TrainingLaunch])


class Part:
    """This host's part of one job: its files, its network and its torchrun agent."""

    def __init__(self, home: Home, launch: TrainingLaunch) -> None:
        self.home, self.launch = home, launch
        self.directory = home.root / "finetune" / f"cluster-job-{launch.job}"
        self.base = home.root / "models" / f"training-job-{launch.job}"
        self.network = JobNetwork(job=launch.job, node=launch.node, hosts=tuple(launch.hosts),
                                  subnet=IPv4Network(launch.subnet))
        self.stack = ExitStack()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, client: httpx.Client, settings: Settings) -> None:
        """Fetch and check the files, lay the job out for this host, bring its network up, start its
        agent; TrainingError (nothing left running) where any of it fails."""
        names = sorted(f.path for f in self.launch.job_files)
        if names != sorted(JOB_FILES):
            raise TrainingError(f"job {self.launch.job}: the head sent the files {names}, not {sorted(JOB_FILES)}")
        fetch(client, f"/cluster/training/{self.launch.job}/job", self.launch.job_files, self.directory)
        fetch(client, f"/cluster/training/{self.launch.job}/base", self.launch.base_files, self.base)
        spec = TrainingSpec.model_validate_json((self.directory / "job.json").read_bytes())
        if spec.node != self.launch.node or spec.strategy != "fsdp":
            raise TrainingError(f"job {self.launch.job}: job.json is for host {spec.node} ({spec.strategy}), not this "
                                f"host's place {self.launch.node} (fsdp)")
        # The head's path to the base is its own: this host's copy is here.
        (self.directory / "job.json").write_text(spec.model_copy(update={"base": self.base}).model_dump_json())
        inputs = [self.directory / name for name in JOB_FILES]
        if settings.finetune.sandbox != "none":
            prepare(self.directory, inputs, [self.base])
        try:
            self.stack.enter_context(job_network(self.network))
            command = sandboxed(multihost_trainer_command(self.directory, self.launch.processes, self.network),
                                settings.finetune, workdir=self.directory, inputs=inputs, readable=[self.base],
                                network=self.network.namespace)
            with (self.directory / "train.log").open("ab") as output:
                self.process = subprocess.Popen(command, cwd=self.directory, stdout=output, stderr=subprocess.STDOUT,
                                                start_new_session=True, env={**os.environ, **TRAINER_ENVIRONMENT})
        except BaseException:
            self.stack.close()
            raise

    def state(self) -> HostPart:
        """Running, or how the agent ended."""
        code = None if self.process is None else self.process.poll()
        state = "running" if code is None else "ended" if code == 0 else "failed"
        detail = None if code in (None, 0) else f"its torchrun agent exited with {code}; see {self.directory}/train.log"
        return HostPart(job=self.launch.job, node=self.launch.node, state=state, exit_code=code, detail=detail,
                        ranks=read_ranks(self.directory))

    def stop(self) -> None:
        """End the agent and its ranks (if still running) and take the job's network down."""
        if self.process is not None and self.process.poll() is None:
            end_group(self.process.pid)
            self.process.wait()
        self.stack.close()


def fetch(client: httpx.Client, route: str, files: list[WeightFile], target: Path) -> None:
    """`files` into `target`, each checked against its SHA-256 (one already there and correct is kept)."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in files:
        path = target / entry.path
        if path.is_file() and not path.is_symlink() and path.stat().st_size == entry.bytes and \
                sha256_file(path) == entry.sha256:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        digest = hashlib.sha256()
        with client.stream("GET", f"{route}/{entry.path}") as response, partial.open("wb") as out:
            if response.status_code != 200:
                raise TrainingError(f"{route}/{entry.path}: the head answered {response.status_code}")
            for chunk in response.iter_bytes(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != entry.sha256:
            partial.unlink()
            raise TrainingError(f"{entry.path}: what the head sent does not match its SHA-256")
        partial.rename(path)


def run(home: Home) -> None:
    joined = membership(home)
    if joined is None:
        raise SystemExit(f"{home.root} has not joined a cluster")
    settings = load_settings(home.settings_file)
    parts: dict[int, Part] = {}
    reported: dict[int, HostPart] = {}
    with head_client(home, joined.head_url, joined.name, credential(home), timeout=30) as client:
        while True:
            try:
                launches = {launch.job: launch for launch in LAUNCHES.validate_json(
                    client.get("/cluster/training").raise_for_status().content)}
            except (httpx.HTTPError, ValidationError) as exc:
                log.warning("asking the head for training launches failed: %s", exc)
                time.sleep(POLL_S)
                continue
            for job in [job for job in parts if job not in launches]:
                parts.pop(job).stop()
                reported.pop(job, None)
                log.warning("job %d: withdrawn by the head; its agent was stopped", job)
            for job, launch in launches.items():
                if job in parts or job in reported:
                    continue
                part = Part(home, launch)
                try:
                    _report(client, HostPart(job=job, node=launch.node, state="fetching"))
                    part.start(client, settings)
                    parts[job] = part
                    log.warning("job %d: started this host's part (host %d)", job, launch.node)
                except (ApplianceError, OSError, httpx.HTTPError, ValidationError) as exc:
                    reported[job] = HostPart(job=job, node=launch.node, state="failed", detail=str(exc)[:4096])
                    _report(client, reported[job])
                    log.error("job %d: this host's part could not start: %s", job, exc)
            for job, part in parts.items():
                state = part.state()
                if reported.get(job) != state:
                    reported[job] = state
                    _report(client, state)
            time.sleep(POLL_S)


def _report(client: httpx.Client, report: HostPart) -> None:
    try:
        client.post("/cluster/training/report", json=report.model_dump()).raise_for_status()
    except httpx.HTTPError as exc:
        log.warning("job %d: the report to the head failed: %s", report.job, exc)


def worker_programs(settings: Settings, home: Home) -> list[Program]:
    """The `appliance.worker_programs` entry point: the training node, on a host that joined."""
    if membership(home) is None:
        return []
    return [Program(name="training-node", command=[python(), "-P", "-m", "finetune.cluster_node"],
                    environment={HOME_ENV: str(home.root)}, priority=95, startsecs=1, stopwaitsecs=10)]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    run(Home.from_env())
