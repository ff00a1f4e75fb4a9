"""Dataset import: every bad row reported by line, and every problem of a file (format, length,
sensitive data) in one pass; sensitive data found and blocked/redacted, reproducible splits,
content-addressed storage, all or nothing; a name taken only with --replace, its versions shown,
removal refused while a job uses it."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from appliance import jobs
from appliance.artifacts import LocalStore
from appliance.datasets import load_registry, remove, versions
from appliance.errors import Conflict, NotFound
from appliance.home import Home
from appliance.sensitive import Scanner, iban_ok, luhn_ok
from appliance.settings import ComplianceSettings
from audit import read_records
from finetune.datasets import (
    DatasetError,
    Row,
    check,
    check_lengths,
    parse,
    scan,
    split,
    store,
)
from tests.support.appliances import APPLIANCE


def jsonl(path: Path, *rows: object) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def chat(user: str, assistant: str = "ok") -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def test_formats_are_normalised(tmp_path: Path) -> None:
    rows = parse(jsonl(tmp_path / "d.jsonl", chat("hi"), {"prompt": "2+2?", "completion": "4"}, {"text": "plain"}))
    assert [r.example for r in rows][1] == chat("2+2?", "4")
    assert rows[2].example == {"text": "plain"} and [r.line for r in rows] == [1, 2, 3]
    text = tmp_path / "d.txt"
    text.write_text("first paragraph\nstill first\n\nsecond\n")
    assert [(r.line, r.example["text"]) for r in parse(text)] == [(1, "first paragraph\nstill first"), (4, "second")]


def test_every_bad_row_is_named_by_line(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "bad.jsonl", chat("fine"), "{not json", {"messages": [{"role": "robot", "content": "x"}]},
                 {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]},
                 {"messages": [{"role": "user", "content": "only a question"}]},
                 {"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "late"},
                               {"role": "assistant", "content": "a"}]},
                 {"prompt": "no completion"}, [1, 2], {"other": 1})
    with pytest.raises(DatasetError) as caught:
        parse(path)
    assert [p.split(":")[0] for p in caught.value.problems] == [f"line {n}" for n in range(2, 10)]
    text = str(caught.value)
    for reason in ("role 'robot' is not one of", "empty user turn", "no assistant turn",
                   "system message may only come first", "'completion' must be non-empty text",
                   "a row must be a JSON object", "expected 'messages'"):
        assert reason in text, reason
    assert "nothing imported" in text


def test_rows_longer_than_the_context_are_named() -> None:
    rows = [Row(1, chat("short")), Row(7, chat("long " * 50))]
    with pytest.raises(DatasetError, match="line 7: .* tokens after the chat template, over the 20-token context"):
        check_lengths(rows, lambda example: len(json.dumps(example).split()), context=20)


PLANTED = [chat("card 4111 1111 1111 1111 please"), chat("write to alice@example.org"),
           chat("IBAN GB82 WEST 1234 5698 7654 32"), chat("call +1 415 555 2671"),
           chat("key AKIAIOSFODNN7EXAMPLE leaked"), chat("order 4111 1111 1111 1112 is not a card")]


def test_sensitive_data_is_found_and_blocked_by_default() -> None:
    rows = [Row(n, e) for n, e in enumerate(PLANTED, start=1)]
    with pytest.raises(DatasetError) as caught:
        scan(rows, Scanner(), "block")
    assert caught.value.problems == ["line 1: payment_card", "line 2: email", "line 3: iban", "line 4: phone",
                                     "line 5: secret"]
    assert "4111" not in str(caught.value) and "alice" not in str(caught.value), "findings never echo the text"
    redacted, counts = scan(rows, Scanner(), "redact")
    assert counts == {"payment_card": 1, "email": 1, "iban": 1, "phone": 1, "secret": 1}
    assert redacted[0].example["messages"][0]["content"] == "card [PAYMENT_CARD] please"
    assert redacted[5].example == PLANTED[5], "a number failing the Luhn check is left alone"
    kept, _ = scan(rows, Scanner(), "allow")
    assert kept[1].example == PLANTED[1]
    custom, counts = scan([Row(1, chat("employee E-123456"))], Scanner({"employee_id": r"E-\d{6}"}), "redact")
    assert counts == {"employee_id": 1} and "E-123456" not in json.dumps(custom[0].example)
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112") and iban_ok("GB82WEST12345698765432")


def test_split_is_reproducible_and_order_independent() -> None:
    rows = [Row(n, chat(f"question {n}")) for n in range(100)]
    train, evaluation = split(rows, 0.1)
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    assert split(shuffled, 0.1) == (train, evaluation)
    assert len(evaluation) == 10 and len(train) == 90


@pytest.mark.integration
def test_cli_imports_all_or_nothing_and_audits(tmp_path: Path, home: Home) -> None:
    env = {"APPLIANCE_HOME": str(home.root), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    model = str(Home.from_env().demo_model)
    good = jsonl(tmp_path / "good.jsonl", *(chat(f"question {n}", f"answer {n}") for n in range(20)))
    added = subprocess.run([APPLIANCE, "data", "add", str(good), "--name", "faq", "--model", model],
                           env=env, capture_output=True, text=True)
    assert added.returncode == 0, added.stderr
    assert "dataset faq: 20 rows (18 train, 2 eval)" in added.stdout
    digest = load_registry(home)["faq"]
    stored = home.root / "artifacts" / "datasets" / digest
    assert len((stored / "train.jsonl").read_text().splitlines()) == 18
    assert json.loads((stored / "meta.json").read_text())["sha256"] == digest
    planted = jsonl(tmp_path / "planted.jsonl", *PLANTED)
    refused = subprocess.run([APPLIANCE, "data", "add", str(planted), "--name", "leaky", "--model", model],
                             env=env, capture_output=True, text=True)
    assert refused.returncode == 1 and "line 1: payment_card" in refused.stderr
    assert set(load_registry(home)) == {"faq"}, "nothing imported from a refused dataset"
    actions = [(r["action"], r["outcome"]) for r in read_records(home.audit)]
    assert actions == [("data.add", "allowed"), ("data.add", "invalid")], "a refused file is the caller's"


def test_a_dataset_changed_in_the_store_is_refused_when_read() -> None:
    """A job re-hashes its dataset's files against the recorded digest."""
    from appliance.datasets import check_dataset, content_digest
    from appliance.errors import IntegrityError

    digest = content_digest(b'{"text": "a"}\n', b'{"text": "b"}\n')
    check_dataset("support", digest, b'{"text": "a"}\n', b'{"text": "b"}\n')
    with pytest.raises(IntegrityError, match="dataset 'support' in the artifact store was changed"):
        check_dataset("support", digest, b'{"text": "poisoned"}\n', b'{"text": "b"}\n')


def test_preference_rows_for_dpo_are_checked_and_never_mixed_with_sft_rows(tmp_path: Path) -> None:
    good = {"prompt": "Add 2 and 2", "chosen": "4", "rejected": [{"role": "assistant", "content": "5"}]}
    [row] = parse(jsonl(tmp_path / "p.jsonl", good))
    assert row.example == {"prompt": [{"role": "user", "content": "Add 2 and 2"}],
                           "chosen": [{"role": "assistant", "content": "4"}],
                           "rejected": [{"role": "assistant", "content": "5"}]}
    bad = jsonl(tmp_path / "bad.jsonl", good, {**good, "rejected": "4"}, {**good, "chosen": ""},
                {**good, "prompt": [{"role": "assistant", "content": "x"}]},
                {**good, "rejected": [{"role": "user", "content": "5"}]})
    with pytest.raises(DatasetError) as caught:
        parse(bad)
    text = str(caught.value)
    for reason in ("line 2: 'chosen' and 'rejected' are the same answer", "line 3: 'chosen' must be non-empty",
                   "line 4: 'prompt' must end with a user turn", "line 5: 'rejected' must be non-empty text or one "
                   "assistant turn"):
        assert reason in text, reason
    with pytest.raises(DatasetError, match="line 1 holds preference rows and line 2 SFT rows: a dataset holds"):
        parse(jsonl(tmp_path / "mixed.jsonl", good, chat("hi")))
    scanned, found = scan([row], Scanner({}), "redact")
    assert found == {} and scanned[0].example == row.example
    leaky = Row(1, {**row.example, "chosen": [{"role": "assistant", "content": "mail bob@example.com"}]})
    [redacted], found = scan([leaky], Scanner({}), "redact")
    assert found == {"email": 1} and "bob@example.com" not in json.dumps(redacted.example)


def words(example: dict[str, Any]) -> int:
    """A token counter for tests: words of the row's JSON."""
    return len(json.dumps(example).split())


def test_every_problem_of_a_file_comes_back_in_one_pass_by_line(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "d.jsonl", chat("fine"), "{not json", chat("long " * 50),
                 chat("mail alice@example.org"), {"prompt": "no completion"},
                 {"prompt": "p", "chosen": "a", "rejected": "b"})
    seen: set[str] = set()
    with pytest.raises(DatasetError) as caught:
        check(path, words, 20, ComplianceSettings(), lambda what, done, total: seen.add(what))
    assert [p.split(":")[0] for p in caught.value.problems] == [f"line {n}" for n in (2, 3, 4, 5, 6)]
    text = str(caught.value)
    for said in ("line 3: 59 tokens after the chat template, over the 20-token context", "line 4: email",
                 "line 6: preference rows among the SFT rows of line 1", "5 problems on 5 lines",
                 "compliance.training_data = block", "nothing imported"):
        assert said in text, said
    assert "alice@" not in text, "findings never echo the text"
    assert seen == {"measuring rows", "scanning for sensitive data"}


def test_a_clean_file_passes_the_one_pass_check_redacted_as_the_settings_say(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "d.jsonl", chat("hi"), chat("mail alice@example.org"))
    checked = check(path, words, 100, ComplianceSettings(training_data="redact"))
    assert checked.sensitive == {"email": 1}
    assert "alice@" not in json.dumps([row.example for row in checked.rows])
    assert check(path, words, 100, ComplianceSettings(training_data="allow")).rows[1].example == chat(
        "mail alice@example.org")


def stored(name: str, text: str, home: Home, artifacts: LocalStore, *, replace: bool = False) -> str:
    return store(name, Path(f"{name}.jsonl"), [chat(text)], [chat(f"{text}?")], {}, "block", artifacts, home,
                 replace=replace).digest


def test_a_name_taken_needs_replace_and_keeps_its_versions(home: Home, store: LocalStore) -> None:
    first = stored("faq", "one", home, store)
    with pytest.raises(Conflict, match="a dataset named 'faq' exists") as caught:
        stored("faq", "two", home, store)
    assert "--replace" in (caught.value.hint or "")
    assert load_registry(home) == {"faq": first}
    second = stored("faq", "two", home, store, replace=True)
    assert load_registry(home) == {"faq": second}
    found = versions(home, store, "faq")
    assert [(v.sha256, v.current, v.rows, v.kind) for v in found] == [(second, True, 2, "SFT rows"),
                                                                      (first, False, 2, "SFT rows")]
    with pytest.raises(NotFound, match="no dataset named 'other'"):
        versions(home, store, "other")


def test_removal_is_refused_while_a_job_that_has_not_ended_uses_it(home: Home, store: LocalStore) -> None:
    digest = stored("faq", "one", home, store)
    shared = stored("copy", "one", home, store)  # the same content under another name
    assert shared == digest
    job = jobs.submit(home, name="bot", data="faq", base="demo", hyperparameters=jobs.Hyperparameters(),
                      eval_sets={})
    with pytest.raises(Conflict, match=f"dataset 'faq' is used by training job {job.id}, queued or running"):
        remove(home, store, "faq")
    jobs.cancel(home, job.id)
    assert remove(home, store, "faq") == [], "files another name uses stay"
    assert set(load_registry(home)) == {"copy"} and store.keys(f"datasets/{digest}/")
    assert remove(home, store, "copy") == [digest]
    assert store.keys("datasets/") == [] and load_registry(home) == {}


def test_the_cli_lists_and_shows_as_json(monkeypatch: pytest.MonkeyPatch, home: Home) -> None:
    from typer.testing import CliRunner

    from finetune.cli import data_app

    monkeypatch.setenv("APPLIANCE_HOME", str(home.root))
    digest = stored("faq", "one", home, LocalStore(home.root / "artifacts"))
    runner = CliRunner()
    listed = runner.invoke(data_app, ["list", "--json"])
    assert json.loads(listed.stdout) == [{"name": "faq", "sha256": digest}]
    shown = runner.invoke(data_app, ["show", "faq", "--json"])
    assert shown.exit_code == 0, shown.output
    [version] = json.loads(shown.stdout)["versions"]
    assert version["sha256"] == digest and version["current"] and version["train"] == 1
    removed = runner.invoke(data_app, ["remove", "faq"])
    assert removed.exit_code == 0 and "dataset faq removed (1 stored versions deleted)" in removed.stdout
