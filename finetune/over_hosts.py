"""The head's side of a training job over several hosts (`finetune run|submit --hosts`): which
joined hosts take part, each host's launch published for its training node (the job's data, a
job.json for its place, the base model's files, the job's network) for as long as the job trains,
and the job stopped when a host's part fails. The head is host 0 of the job; its first process is
the job's first rank, which writes the result and the adapter here.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from ipaddress import IPv4Address
from pathlib import Path

from appliance import hosts as host_registry
from appliance import training_launches
from appliance.home import Home
from appliance.hosts import HostRecord, HostState, WeightFile, weight_files
from appliance.jobs import host_parts, part_tag
from appliance.settings import Settings
from appliance.training_launches import Published, TrainingLaunch
from finetune.train import TrainingError, TrainingSpec
from finetune.training_network import JobNetwork, job_network

JOB_FILES = ("train.jsonl", "eval.jsonl")


def worker_hosts(home: Home, settings: Settings, names: list[str]) -> list[HostRecord]:
    """The joined hosts `names` (`all`: every joined host), or TrainingError saying why not."""
    if settings.cluster.bind is None:
        raise TrainingError("a job over several hosts trains over the cluster network, and cluster.bind is unset",
                            hint="set cluster.bind to the head's address on it (docs/deploy/multi-host.md)")
    if os.geteuid() != 0:
        raise TrainingError("a job over several hosts needs the appliance to run as root (its network namespace "
                            "and rules on each host)")
    joined = {name: host for name, host in host_registry.load(home).hosts.items() if host.state == HostState.JOINED}
    wanted = sorted(joined) if names == ["all"] else names
    if unknown := [name for name in wanted if name not in joined]:
        raise TrainingError(f"--hosts {', '.join(unknown)}: not a joined host",
                            hint=f"joined hosts: {', '.join(sorted(joined)) or 'none'} (appliance hosts list)")
    if not wanted or len(set(wanted)) != len(wanted):
        raise TrainingError(f"--hosts {','.join(names)}: name each joined host once (or all)")
    found = [joined[name] for name in wanted]
    if missing := [host.name for host in found if not host.address]:
        raise TrainingError(f"host {', '.join(missing)}: its cluster address is not known", hint="join it again")
    return found


@contextmanager
def parts_published(home: Home, settings: Settings, directory: Path, spec: TrainingSpec, processes: int,
                    workers: list[HostRecord]) -> Iterator[JobNetwork]:
    """Each worker's launch published, and this host's namespace of the job's network up, while the
    block runs; withdrawn and taken down after, however it ends."""
    job = part_tag(directory)
    net = JobNetwork(job=job, node=0, hosts=(str(settings.cluster.bind), *[str(w.address) for w in workers]),
                     subnet=settings.finetune.training_subnet)
    base = spec.base
    base_files = weight_files(base)
    try:
        for node, worker in enumerate(workers, start=1):
            contents = {name: (directory / name).read_bytes() for name in JOB_FILES}
            contents["job.json"] = spec.model_copy(update={"node": node}).model_dump_json().encode()
            files = [WeightFile(path=name, bytes=len(content), sha256=hashlib.sha256(content).hexdigest())
                     for name, content in contents.items()]
            launch = TrainingLaunch(job=job, node=node, hosts=list(map(IPv4Address, net.hosts)), subnet=net.subnet,
                                    processes=processes, base_files=base_files, job_files=files)
            training_launches.publish(home, worker.name, Published(launch=launch, base_dir=str(base)), contents)
        with job_network(net):
            yield net
    finally:
        for worker in workers:
            training_launches.withdraw(home, worker.name, job)


def failed_part(home: Home, workers: list[HostRecord], directory: Path) -> None:
    """TrainingError naming the host whose part failed, if one has."""
    for worker, report in host_parts(home, [w.name for w in workers], directory).items():
        if report is not None and report.state == "failed":
            raise TrainingError(f"host {worker}'s part of the job failed: {report.detail}",
                                hint=f"its training node's log on {worker}")
