"""A training job's part on each worker host of a job over several hosts: what the head publishes
for a host (its place in the job, the job's hosts and network, its processes, and the files it
takes: the job's data and job.json for its place, and the base model), what the host reports
back, and the files a launch hands out, only while they are plain files of its listing.

The head's runner publishes a launch per worker host while the job trains (run/training/HOST/JOB.json)
and withdraws it when the job ends, however it ends; each worker's `training-node` asks the head
for its launches (the cluster listener, with the host's credential), runs its torchrun agent for
each, stops the agent of a launch withdrawn, and reports (appliance.jobs.HostPart).
"""

from __future__ import annotations

import contextlib
import shutil
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from appliance.durable import read_small_file, replace_file
from appliance.home import Home
from appliance.hosts import WeightFile
from appliance.jobs import training_dir

MAX_RECORD_BYTES = 1 << 22
Kind = Literal["job", "base"]


class TrainingLaunch(BaseModel):
    """What a worker host runs of a job: the head sends it, the host checks every file (and its
    subnet against its own finetune.training_subnet)."""

    model_config = ConfigDict(extra="forbid")

    job: int = Field(ge=0, le=999_999, description="The job's tag (appliance.jobs.part_tag).")
    node: int = Field(ge=1, le=255, description="This host's place in the job (0 is the head).")
    hosts: list[IPv4Address] = Field(min_length=2, max_length=256, description="Each host's cluster address, by place.")
    subnet: IPv4Network = Field(description="finetune.training_subnet, as the head has it.")
    processes: int = Field(ge=1, le=1024)
    job_files: list[WeightFile] = Field(min_length=1, max_length=8)
    base_files: list[WeightFile] = Field(min_length=1, max_length=100_000)

    @model_validator(mode="after")
    def _a_place_among_the_hosts(self) -> TrainingLaunch:
        if self.node >= len(self.hosts):
            raise ValueError(f"place {self.node} among {len(self.hosts)} hosts")
        return self


class Published(BaseModel):
    """The head's record of a launch: the launch and where its base is on the head (its job files
    are copies in the head's own records: `job_files_dir`, which no trainer can write)."""

    model_config = ConfigDict(extra="forbid")

    launch: TrainingLaunch
    base_dir: str


def job_files_dir(home: Home, host: str, job: int) -> Path:
    """Where the head keeps the copies of `host`'s job files of `job` it hands out (run/, 0700)."""
    return training_dir(home, host) / f"{job}.files"


def publish(home: Home, host: str, published: Published, job_files: dict[str, bytes]) -> None:
    """`host`'s launch, in place of any earlier one of the job (and its reports), with copies of its
    job files (name -> content) where only the head writes: the job's own directory is the
    trainer's to write, which could put a link where a file was."""
    directory = training_dir(home, host)
    directory.mkdir(parents=True, mode=0o700, exist_ok=True)
    files = job_files_dir(home, host, published.launch.job)
    shutil.rmtree(files, ignore_errors=True)
    files.mkdir(mode=0o700)
    for name, content in job_files.items():
        replace_file(files / name, content)
    # An earlier run's word on this part (a failed host's) is not this run's.
    (directory / f"{published.launch.job}.report.json").unlink(missing_ok=True)
    replace_file(directory / f"{published.launch.job}.json", published.model_dump_json().encode())


def withdraw(home: Home, host: str, job: int) -> None:
    """The launch gone (the host's reports on it stay: what `finetune status` shows of the host)."""
    with contextlib.suppress(FileNotFoundError):
        (training_dir(home, host) / f"{job}.json").unlink()
    shutil.rmtree(job_files_dir(home, host, job), ignore_errors=True)


def has_part(home: Home, host: str, job: int, node: int) -> bool:
    """Whether `host` has a launch of `job` at place `node` (its report on it is kept only then)."""
    return any(p.launch.job == job and p.launch.node == node for p in published(home, host))


def published(home: Home, host: str) -> list[Published]:
    """The launches published for `host` (a record that is not one is left out)."""
    found = []
    directory = training_dir(home, host)
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        if path.name.endswith(".report.json") or (read := read_small_file(path, MAX_RECORD_BYTES)) is None:
            continue
        with contextlib.suppress(ValueError):
            found.append(Published.model_validate_json(read[0]))
    return found


def file_of(home: Home, host: str, job: int, kind: Kind, path: str) -> Path | None:
    """Where `path` of `host`'s launch of `job` is on the head, if its listing holds it and it is a
    plain file inside its directory; None otherwise."""
    launch = next((p for p in published(home, host) if p.launch.job == job), None)
    if launch is None:
        return None
    base = job_files_dir(home, host, job) if kind == "job" else Path(launch.base_dir)
    listed = launch.launch.job_files if kind == "job" else launch.launch.base_files
    target = base / path
    if path not in {f.path for f in listed} or target.is_symlink() or not target.is_file() \
            or not target.resolve().is_relative_to(base.resolve()):
        return None
    return target
