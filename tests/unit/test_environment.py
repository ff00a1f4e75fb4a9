"""Agent episodes without a sandbox: the tools' schemas pass the gateway's check (so an episode's
requests are never refused for them) and agree with the environment on what a call may carry;
repository tasks refuse bad paths and sets by name; the task and episode files are read with a
clear error naming the file and where."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from appliance.errors import Invalid
from appliance.rl.episodes import Episode
from appliance.rl.tasks import MAX_REPOSITORY_BYTES, RepositoryTask
from finetune.rl.cli_episodes import read_model
from finetune.rl.environment import TOOL_SCHEMAS, TOOLS
from serve.tool_calls import ToolCheck


def task(**changes: object) -> dict[str, object]:
    files = {"pkg/mod.py": "x = 1\n", "tests/test_mod.py": "def test_x(): pass\n"}
    return {"id": "t", "instruction": "fix it", "files": files, "tests": ["tests/test_mod.py"], **changes}


def test_the_tools_schemas_pass_the_gateway_s_check_and_agree_with_the_environment() -> None:
    check = ToolCheck.of(TOOL_SCHEMAS, "auto")
    assert check is not None and sorted(check.functions) == sorted(TOOLS)
    assert check.problem("read_file", json.dumps({"path": "a.py", "start_line": 2})) is None
    assert check.problem("write_file", json.dumps({"path": "a.py", "content": "x"})) is None
    assert check.problem("submit", "{}") is None
    # What the gateway refuses, the environment would too: extra keys, wrong types, missing ones.
    for name, arguments in (("read_file", {"path": "a", "mode": "w"}), ("read_file", {"path": 3}),
                            ("write_file", {"path": "a"}), ("shell", {"command": ""}),
                            ("search", {"text": "x" * 201})):
        assert check.problem(name, json.dumps(arguments)) is not None, (name, arguments)
        with pytest.raises(ValidationError):
            TOOLS[name].model_validate(arguments)


@pytest.mark.parametrize(("changes", "said"), [
    ({"files": {"../x.py": ""}, "tests": ["../x.py"]}, "relative path"),
    ({"files": {"/etc/x.py": ""}, "tests": ["/etc/x.py"]}, "relative path"),
    ({"files": {".hidden/t.py": ""}, "tests": [".hidden/t.py"]}, "relative path"),
    ({"files": {"a//b.py": ""}, "tests": ["a//b.py"]}, "relative path"),
    ({"files": {"a\nb.py": ""}, "tests": ["a\nb.py"]}, "relative path"),
    ({"files": {"a/" * 9 + "t.py": ""}, "tests": ["a/" * 9 + "t.py"]}, "at most 8 parts"),
    ({"tests": ["tests/other.py"]}, "tests not among the files"),
    ({"tests": []}, "at least 1 item"),
    ({"files": {"big.py": "x" * (MAX_REPOSITORY_BYTES + 1)}, "tests": ["big.py"]}, "bytes"),
    ({"id": "two words"}, "pattern"),
    ({"files": ["pkg/mod.py"]}, "valid dictionary"),
    ({"extra": 1}, "Extra inputs"),
])
def test_a_repository_task_is_refused_naming_what_is_wrong(changes: dict[str, object], said: str) -> None:
    with pytest.raises(ValidationError, match=said):
        RepositoryTask.model_validate(task(**changes))


def test_files_are_read_with_the_place_of_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "task.json"
    path.write_text(json.dumps(task()))
    assert read_model(path, RepositoryTask, "--task").test_files() == {"tests/test_mod.py": "def test_x(): pass\n"}
    path.write_text('{"id": "t",\n "instruction": }')
    with pytest.raises(Invalid, match=r"task.json:2:17: not JSON"):
        read_model(path, RepositoryTask, "--task")
    path.write_bytes(b'{"id": "\xff"}')
    with pytest.raises(Invalid, match="not UTF-8 text"):
        read_model(path, RepositoryTask, "--task")
    path.write_text(json.dumps(task(tests=["nope.py"])))
    with pytest.raises(Invalid, match=r"\[top\]: Value error, tests not among the files"):
        read_model(path, RepositoryTask, "--task")
    path.write_text(json.dumps({"task": "t"}))
    with pytest.raises(Invalid, match=r"episode .*: \[model\]: Field required"):
        read_model(path, Episode, "episode")
    with pytest.raises(Invalid, match="cannot read it"):
        read_model(tmp_path / "missing.json", Episode, "episode")
