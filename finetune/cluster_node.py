"""A worker host's `training-node` (`python -m finetune.cluster_node`): this host's part of the
training jobs over several hosts that the head publishes for it (appliance.training_launches).

For each launch it fetches the job's files and the base model from the head (each file's SHA-256
checked; files already here and correct are not fetched again), brings up its namespace of the
job's network (finetune.training_network), and runs its torchrun agent in the training sandbox
inside it; it reports each part's state to the head, stops the agent of a launch the head
withdrew (the job ended, was cancelled, or failed on another host), and takes the network down.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from pydantic import TypeAdapter, ValidationError

from appliance.cluster_client import credential, head_client
from appliance.durable import replace_file
from appliance.engine_launch import python
from appliance.errors import ApplianceError
from appliance.home import HOME_ENV, Home
from appliance.hosts import WeightFile, membership
from appliance.jobs import HostPart, read_progress, read_ranks
from appliance.programs import Program
from appliance.settings import Settings, load_settings
from appliance.training_launches import TrainingLaunch
from finetune.runner import end_group, multihost_trainer_command, open_log
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
        self.network = JobNetwork(job=launch.job, node=launch.node, hosts=tuple(map(str, launch.hosts)),
                                  subnet=launch.subnet)
        self.stack = ExitStack()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, client: httpx.Client, settings: Settings) -> None:
        """Fetch and check the files, lay the job out for this host, bring its network up, start its
        agent; TrainingError (nothing left running) where any of it fails."""
        names = sorted(f.path for f in self.launch.job_files)
        if names != sorted(JOB_FILES):
            raise TrainingError(f"job {self.launch.job}: the head sent the files {names}, not {sorted(JOB_FILES)}")
        if self.launch.subnet != settings.finetune.training_subnet:
            raise TrainingError(f"job {self.launch.job}: the head's training subnet {self.launch.subnet} is not this "
                                f"host's finetune.training_subnet {settings.finetune.training_subnet}",
                                hint="set the same finetune.training_subnet on every host")
        # An earlier run's trainer owned this directory: what it left where the job's files go is removed.
        clear_planted(self.directory, [*JOB_FILES, "train.log"])
        fetch(client, f"/cluster/training/{self.launch.job}/job", self.launch.job_files, self.directory)
        fetch(client, f"/cluster/training/{self.launch.job}/base", self.launch.base_files, self.base)
        spec = TrainingSpec.model_validate_json((self.directory / "job.json").read_bytes())
        if spec.node != self.launch.node or spec.strategy != "fsdp":
            raise TrainingError(f"job {self.launch.job}: job.json is for host {spec.node} ({spec.strategy}), not this "
                                f"host's place {self.launch.node} (fsdp)")
        # The head's path to the base is its own: this host's copy is here.
        here = spec.model_copy(update={"base": self.base})
        replace_file(self.directory / "job.json", here.model_dump_json().encode())
        inputs = [self.directory / name for name in JOB_FILES]
        if settings.finetune.sandbox != "none":
            prepare(self.directory, inputs, [self.base])
        try:
            self.stack.enter_context(job_network(self.network))
            command = sandboxed(multihost_trainer_command(self.directory, self.launch.processes, self.network),
                                settings.finetune, workdir=self.directory, inputs=inputs, readable=[self.base],
                                network=self.network.namespace)
            with open_log(self.directory / "train.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT) as output:
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
                        ranks=read_ranks(self.directory), progress=read_progress(self.directory))

    def stop(self) -> None:
        """End the agent and its ranks (if still running) and take the job's network down."""
        if self.process is not None and self.process.poll() is None:
            end_group(self.process.pid)
            self.process.wait()
        self.stack.close()


def clear_planted(directory: Path, names: list[str]) -> None:
    """Remove from `directory` what is at `names` (and any partial download) unless it is a plain
    file: a link or a pipe the sandboxed trainer put there, which root must not write through."""
    if not directory.is_dir():
        return
    for path in [*(directory / name for name in names), *directory.glob(".*.partial")]:
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.lstat(path).st_mode) or path.name.endswith(".partial"):
                path.unlink()


def fetch(client: httpx.Client, route: str, files: list[WeightFile], target: Path) -> None:
    """`files` into `target`, each checked against its size and SHA-256 (one already there as a
    plain file and correct is kept); written only as new files, never through a link."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in files:
        path = target / entry.path
        if _holds(path, entry):
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.unlink(missing_ok=True)
        digest, received = hashlib.sha256(), 0
        with client.stream("GET", f"{route}/{entry.path}") as response, \
                os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb") as out:
            if response.status_code != 200:
                raise TrainingError(f"{route}/{entry.path}: the head answered {response.status_code}")
            for chunk in response.iter_bytes(1 << 20):
                received += len(chunk)
                if received > entry.bytes:
                    break  # more than listed: refused below, the disk not filled
                digest.update(chunk)
                out.write(chunk)
        if received != entry.bytes or digest.hexdigest() != entry.sha256:
            partial.unlink()
            raise TrainingError(f"{entry.path}: what the head sent does not match its size and SHA-256")
        partial.rename(path)  # over a link, if one is there: the link is replaced, never followed


def _holds(path: Path, entry: WeightFile) -> bool:
    """Whether `path` is a plain file with `entry`'s size and SHA-256 (read through no link)."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    with os.fdopen(handle, "rb") as found:
        info = os.fstat(found.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size != entry.bytes:
            return False
        digest = hashlib.sha256()
        for block in iter(lambda: found.read(1 << 20), b""):
            digest.update(block)
        return digest.hexdigest() == entry.sha256


class Node:
    """This host's parts of jobs, kept in step with the launches the head publishes for it."""

    def __init__(self, home: Home, settings: Settings) -> None:
        self.home, self.settings = home, settings
        self.parts: dict[int, Part] = {}
        self.reported: dict[int, HostPart] = {}

    def tick(self, client: httpx.Client, launches: dict[int, TrainingLaunch]) -> None:
        """Stop the parts the head withdrew, start the new ones, report what changed."""
        for job in [job for job in self.parts if job not in launches]:
            self.parts.pop(job).stop()
            log.warning("job %d: withdrawn by the head; its agent was stopped", job)
        for job in [job for job in self.reported if job not in launches]:
            del self.reported[job]  # a part that failed to start is tried again when the job runs again
        for job, launch in launches.items():
            if job in self.parts or job in self.reported:
                continue
            try:
                part = Part(self.home, launch)
                _report(client, HostPart(job=job, node=launch.node, state="fetching"))
                part.start(client, self.settings)
                self.parts[job] = part
                log.warning("job %d: started this host's part (host %d)", job, launch.node)
            except (ApplianceError, OSError, httpx.HTTPError, ValidationError) as exc:
                self.reported[job] = HostPart(job=job, node=launch.node, state="failed", detail=said(str(exc)))
                _report(client, self.reported[job])
                log.error("job %d: this host's part could not start: %s", job, exc)
        for job, part in self.parts.items():
            state = part.state()
            if self.reported.get(job) != state:
                self.reported[job] = state
                _report(client, state)

    def stop(self) -> None:
        for part in self.parts.values():
            part.stop()
        self.parts.clear()


def run(home: Home) -> None:
    joined = membership(home)
    if joined is None:
        raise SystemExit(f"{home.root} has not joined a cluster")
    node = Node(home, load_settings(home.settings_file))
    # supervisord's stop: the parts' agents are ended and their networks taken down on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with head_client(home, joined.head_url, joined.name, credential(home), timeout=30) as client:
            while True:
                try:
                    launches = {launch.job: launch for launch in LAUNCHES.validate_json(
                        client.get("/cluster/training").raise_for_status().content)}
                except (httpx.HTTPError, ValidationError) as exc:
                    log.warning("asking the head for training launches failed: %s", exc)
                else:
                    node.tick(client, launches)
                time.sleep(POLL_S)
    finally:
        node.stop()


def said(text: str) -> str:
    """A reason as one line the head can show: control characters as spaces, at most 4 KiB."""
    return re.sub(r"[\x00-\x1f\x7f]", " ", text)[:4096]


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
