"""Training jobs over several hosts, the head's records and choices: a launch published for a host
hands out only the files of its listing (never another's, never through a link, never outside the
base's directory), a report is kept only from a host that has the launch, withdrawn launches are
gone; the hosts named with --hosts are joined ones, named once (or all); a worker's training node
checks every file it fetches and refuses a launch whose files or job.json are not for its place."""

from __future__ import annotations

import hashlib
import json
import os
from ipaddress import IPv4Network
from pathlib import Path

import httpx
import pytest

from appliance import hosts as host_registry
from appliance import training_launches
from appliance.home import Home
from appliance.hosts import WeightFile
from appliance.jobs import HostPart, Hyperparameters, record_part, training_dir
from appliance.settings import Settings
from appliance.training_launches import Published, TrainingLaunch
from finetune.cluster_node import Node, Part, clear_planted, fetch, said
from finetune.over_hosts import worker_hosts
from finetune.train import TrainingError, TrainingSpec

CA = "0" * 64


def entry(path: Path, name: str) -> WeightFile:
    return WeightFile(path=name, bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())


@pytest.fixture
def launched(home: Home, tmp_path: Path) -> tuple[Home, Path, Path]:
    job, base = tmp_path / "job", tmp_path / "base"
    job.mkdir()
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "secret.txt").write_text("not listed")
    (tmp_path / "outside.bin").write_text("outside")
    (base / "escape.bin").symlink_to(tmp_path / "outside.bin")
    contents = {"train.jsonl": b"rows", "eval.jsonl": b"held out", "job.json": b"{}"}
    launch = TrainingLaunch(job=7, node=1, hosts=["10.0.0.1", "10.0.0.2"], subnet="10.77.0.0/16", processes=1,
                            job_files=[WeightFile(path=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
                                       for name, data in contents.items()],
                            base_files=[entry(base / "config.json", "config.json"),
                                        WeightFile(path="escape.bin", bytes=7, sha256="0" * 64)])
    training_launches.publish(home, "w1", Published(launch=launch, base_dir=str(base)), contents)
    return home, job, base


def test_a_launch_hands_out_only_the_files_it_lists(launched: tuple[Home, Path, Path]) -> None:
    home, job, base = launched
    assert [p.launch.job for p in training_launches.published(home, "w1")] == [7]
    assert training_launches.published(home, "w2") == []
    served = training_launches.file_of(home, "w1", 7, "job", "job.json")
    # A copy where only the head writes, never the job's own directory (the trainer's to write).
    assert served == training_launches.job_files_dir(home, "w1", 7) / "job.json" and served.read_bytes() == b"{}"
    assert training_launches.file_of(home, "w1", 7, "base", "config.json") == base / "config.json"
    for kind, path in (("base", "secret.txt"), ("base", "escape.bin"), ("base", "../job/train.jsonl"),
                       ("job", "job-host-1.json"), ("job", "../base/config.json")):
        assert training_launches.file_of(home, "w1", 7, kind, path) is None, (kind, path)  # type: ignore[arg-type]
    assert training_launches.file_of(home, "w2", 7, "job", "job.json") is None  # another host's
    assert training_launches.file_of(home, "w1", 8, "job", "job.json") is None  # another job


def test_a_host_s_part_is_known_only_where_it_has_the_launch_and_a_new_launch_forgets_its_old_word(
        launched: tuple[Home, Path, Path]) -> None:
    home, _, _ = launched
    assert training_launches.has_part(home, "w1", 7, 1)
    assert not training_launches.has_part(home, "w2", 7, 1) and not training_launches.has_part(home, "w1", 7, 2)
    record_part(home, "w1", HostPart(job=7, node=1, state="failed", detail="no space"))
    [found] = training_launches.published(home, "w1")
    training_launches.withdraw(home, "w1", 7)
    assert training_launches.published(home, "w1") == [] and not training_launches.job_files_dir(home, "w1", 7).exists()
    assert (training_dir(home, "w1") / "7.report.json").exists()  # what status shows of the host, after
    training_launches.publish(home, "w1", found, {"job.json": b"{}"})  # the job's next run
    assert not (training_dir(home, "w1") / "7.report.json").exists()


def joined(home: Home, *names: str) -> None:
    for name in names:
        token = host_registry.invite(home, name, 600, CA)
        host_registry.redeem(home, name, token.split(".")[2], f"10.0.0.{len(name)}")


@pytest.mark.parametrize(("names", "said"), [
    (["w9"], "--hosts w9: not a joined host"), (["invited"], "--hosts invited: not a joined host"),
    (["w1", "w1"], "name each joined host once"),
])
def test_the_hosts_of_a_job_are_joined_ones_named_once(home: Home, names: list[str], said: str) -> None:
    joined(home, "w1", "w22")
    host_registry.invite(home, "invited", 600, CA)
    settings = Settings.model_validate({"cluster": {"bind": "10.0.0.1"}})
    assert [h.name for h in worker_hosts(home, settings, ["w22"])] == ["w22"]
    assert [h.name for h in worker_hosts(home, settings, ["all"])] == ["w1", "w22"]
    with pytest.raises(TrainingError, match=said):
        worker_hosts(home, settings, names)
    with pytest.raises(TrainingError, match="cluster.bind is unset"):
        worker_hosts(home, Settings(), ["w1"])


def served(files: dict[str, bytes]) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        name = request.url.path.rsplit("/", 1)[-1]
        return httpx.Response(200, content=files[name]) if name in files else httpx.Response(404)

    return httpx.Client(transport=httpx.MockTransport(answer), base_url="https://head")


def test_root_never_writes_through_what_a_trainer_planted_in_the_worker_s_job_directory(tmp_path: Path) -> None:
    """An earlier run's trainer owned the directory: links and pipes where the job's files, the log
    and partial downloads go are removed, and a fetch writes new files only."""
    directory, victim = tmp_path / "job", tmp_path / "victim"
    directory.mkdir()
    victim.write_text("root's")
    for name in ("train.log", "job.json", ".train.jsonl.partial"):
        (directory / name).symlink_to(victim)
    os.mkfifo(directory / "eval.jsonl")
    (directory / "checkpoints").mkdir()  # the trainer's own: kept
    clear_planted(directory, ["train.jsonl", "eval.jsonl", "job.json", "train.log"])
    assert sorted(p.name for p in directory.iterdir()) == ["checkpoints"]
    (directory / "train.jsonl").symlink_to(victim)  # one planted after the sweep: replaced, not followed
    data = WeightFile(path="train.jsonl", bytes=3, sha256=hashlib.sha256(b"abc").hexdigest())
    fetch(served({"train.jsonl": b"abc"}), "/cluster/training/7/job", [data], directory)
    assert victim.read_text() == "root's" and not (directory / "train.jsonl").is_symlink()
    assert (directory / "train.jsonl").read_bytes() == b"abc"


def test_a_fetched_file_that_does_not_match_its_digest_is_refused_and_not_kept(tmp_path: Path) -> None:
    good = WeightFile(path="a.bin", bytes=3, sha256=hashlib.sha256(b"abc").hexdigest())
    fetch(served({"a.bin": b"abc"}), "/cluster/training/7/base", [good], tmp_path / "ok")
    assert (tmp_path / "ok" / "a.bin").read_bytes() == b"abc"
    for sent in (b"abd", b"abcd" * 1000):  # changed; more than listed (read no further)
        with pytest.raises(TrainingError, match="a.bin: what the head sent does not match its size and SHA-256"):
            fetch(served({"a.bin": sent}), "/cluster/training/7/base", [good], tmp_path / "bad")
        assert not list((tmp_path / "bad").iterdir())
    with pytest.raises(TrainingError, match="answered 404"):
        fetch(served({}), "/cluster/training/7/base", [good], tmp_path / "none")


def test_a_worker_refuses_a_launch_that_is_not_for_its_place(home: Home, tmp_path: Path) -> None:
    spec = TrainingSpec(base=Path("/head/models/base"), hyperparameters=Hyperparameters(), strategy="fsdp", node=2)
    files = {"train.jsonl": b"{}\n", "eval.jsonl": b"{}\n", "job.json": spec.model_dump_json().encode(),
             "config.json": b"{}"}
    listing = {name: WeightFile(path=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
               for name, data in files.items()}
    launch = TrainingLaunch(job=7, node=1, hosts=["10.0.0.1", "10.0.0.2"], subnet=str(IPv4Network("10.77.0.0/16")),
                            processes=1, job_files=[listing[n] for n in ("train.jsonl", "eval.jsonl", "job.json")],
                            base_files=[listing["config.json"]])
    with pytest.raises(TrainingError, match="job.json is for host 2 \\(fsdp\\), not this host's place 1"):
        Part(home, launch).start(served(files), Settings())
    elsewhere = launch.model_copy(update={"subnet": IPv4Network("10.1.0.0/16")})
    with pytest.raises(TrainingError, match="training subnet 10.1.0.0/16 is not this host's"):
        Part(home, elsewhere).start(served(files), Settings())
    odd = launch.model_copy(update={"job_files": [listing["train.jsonl"], listing["job.json"]]})
    with pytest.raises(TrainingError, match="the head sent the files"):
        Part(home, odd).start(served(files), Settings())
    assert json.loads(files["job.json"])["node"] == 2


@pytest.mark.parametrize("changes", [{"node": 2}, {"job": 10**6}, {"hosts": ["10.0.0.1", "not an address"]},
                                     {"subnet": "10.77.0.0/33"}])
def test_a_launch_a_head_could_send_that_is_not_one_is_refused(changes: dict[str, object]) -> None:
    launch = {"job": 7, "node": 1, "hosts": ["10.0.0.1", "10.0.0.2"], "subnet": "10.77.0.0/16", "processes": 1,
              "job_files": [{"path": "a", "bytes": 1, "sha256": "0" * 64}],
              "base_files": [{"path": "b", "bytes": 1, "sha256": "0" * 64}]}
    TrainingLaunch.model_validate(launch)
    with pytest.raises(ValueError):
        TrainingLaunch.model_validate({**launch, **changes})


def test_a_host_s_word_on_its_part_is_one_line() -> None:
    with pytest.raises(ValueError):
        HostPart(job=7, node=1, state="failed", detail="ok\x1b[2Jrm -rf /")
    assert said("line one\nline\ttwo") == "line one line two"


def test_a_job_over_hosts_shows_each_host_s_part_in_status_the_api_s_report_and_the_tui(home: Home) -> None:
    from appliance import jobs
    from finetune.cli import _progress_text

    job = jobs.submit(home, name="bot", data="d", base="demo", eval_sets={},
                      hyperparameters=Hyperparameters(hosts=["w1", "w2"]))
    tag = jobs.part_tag(jobs.job_dir(home, job.id))
    rank = jobs.RankMemory(rank=1, host="w1", pid=9, base_parameter_bytes=1, adapter_parameter_bytes=1,
                           optimizer_bytes=1, peak_rss_bytes=3 * 2**29)
    seen = jobs.Progress(step=3, max_steps=10, loss=1.25, tokens_per_s=40, eta_s=70)  # as the host's first rank saw it
    record_part(home, "w1", HostPart(job=tag, node=1, state="running", ranks=[rank], progress=seen))
    report = jobs.report(home, job)
    assert report.hosts == {"w1": HostPart(job=tag, node=1, state="running", ranks=[rank], progress=seen), "w2": None}
    line = ("hosts: w1 running training: step 3/10, loss 1.250, 40 tokens/s, ETA 70 s (1 rank, peak 1.5 GiB), "
            "w2 not reported")
    assert _progress_text(home, job) == line
    directory = jobs.job_dir(home, job.id)  # the head's own ranks, against the planner's estimate of one
    (directory / jobs.RANKS_DIR).mkdir(parents=True)
    (directory / jobs.RANKS_DIR / "rank-0.json").write_text(rank.model_copy(update={"rank": 0}).model_dump_json())
    (directory / jobs.LAUNCH_FILE).write_text(jobs.Launch(strategy="fsdp", processes=1, seq_len=40,
                                                          estimated_process_bytes=2**30).model_dump_json())
    assert _progress_text(home, job) == f"here: 1 rank, peak 1.5 GiB a rank (estimated 1.0 GiB); {line}"
    assert jobs.report(home, job).estimated_process_bytes == 2**30
    (training_dir(home, "w2") / f"{tag}.report.json").parent.mkdir(parents=True)
    (training_dir(home, "w2") / f"{tag}.report.json").write_text("not a report")  # written by no one we trust
    assert jobs.report(home, job).hosts["w2"] is None
    assert jobs.hosts_line({}) == "" and jobs.report(home, jobs.submit(
        home, name="solo", data="d", base="demo", eval_sets={}, hyperparameters=Hyperparameters())).hosts == {}


def test_a_part_that_failed_to_start_is_tried_again_when_the_job_runs_again(home: Home) -> None:
    """Its failure is reported once a run; once the head withdrew the job, a later run starts afresh."""
    reports: list[dict[str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            reports.append(json.loads(request.content))
        return httpx.Response(200, json={"accepted": True})

    client = httpx.Client(transport=httpx.MockTransport(answer), base_url="https://head")
    odd = TrainingLaunch(job=7, node=1, hosts=["10.0.0.1", "10.0.0.2"], subnet="10.77.0.0/16", processes=1,
                         job_files=[WeightFile(path="other.bin", bytes=1, sha256="0" * 64)],
                         base_files=[WeightFile(path="config.json", bytes=1, sha256="0" * 64)])
    node = Node(home, Settings())
    node.tick(client, {7: odd})
    node.tick(client, {7: odd})  # the same run: reported once
    assert [(r["state"], r["detail"] is not None) for r in reports] == [("fetching", False), ("failed", True)]
    node.tick(client, {})  # withdrawn
    node.tick(client, {7: odd})  # the job runs again
    assert [r["state"] for r in reports] == ["fetching", "failed", "fetching", "failed"]
    assert node.parts == {}
