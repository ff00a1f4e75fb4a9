"""Every command reads the same way (docs/operate/cli.md): within a group each command is a verb
(`GROUP VERB [OBJECT]`), every list and show takes --json, and help names no types. Walks the whole
tree as the root loads it, hidden old spellings left out."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from typer import _click
from typer.testing import CliRunner

from appliance import cli

# What a command within a group may be called: a verb, alone or naming what it acts on
# (`reset-password`, `list-roles`).
VERBS = {"add", "archive", "build", "cancel", "canary", "create", "deploy", "disable", "enable", "exec",
         "export", "flush", "gate", "grant", "install", "join", "list", "prepare", "remove", "renew", "reset",
         "restore", "retire", "revoke", "rollback", "run", "show", "status", "submit", "tail", "unlock", "verify",
         "set", "apply", "limit", "make", "replay"}
READS = {"list", "show", "status"}  # these take --json
# Commands in groups that other people's modules own, not yet renamed to the style: path -> the owner.
NOT_YET: dict[str, str] = {}
TYPE_LABELS = ("<bool>", "<str>", "<int", "<float", "<path>", "TEXT", "INTEGER", "FLOAT", "BOOLEAN")


def commands() -> Iterator[tuple[str, _click.Command, bool]]:
    """Every visible command: its path after `appliance`, the command, whether it is in a group."""

    def walk(command: _click.Command, path: str, grouped: bool) -> Iterator[tuple[str, _click.Command, bool]]:
        if command.hidden:
            return
        yield path, command, grouped
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, f"{path} {name}", True)

    for name, target in cli.command_targets().items():
        yield from walk(cli.load_command(name, target), name, False)


def test_every_command_in_a_group_is_a_verb() -> None:
    wrong = [path for path, command, grouped in commands()
             if grouped and not hasattr(command, "commands") and path not in NOT_YET
             and path.split()[-1].split("-")[0] not in VERBS]
    assert not wrong, f"not GROUP VERB [OBJECT] (docs/operate/cli.md): {wrong}"


def test_every_list_and_show_takes_json() -> None:
    leaves = [(path, command) for path, command, _ in commands() if not hasattr(command, "commands")]
    reads = [(path, command) for path, command in leaves if path.split()[-1].split("-")[0] in READS]
    assert {"users list", "adapters list", "data list", "data show", "finetune status", "hosts list"} <= {
        path for path, _ in reads}
    missing = [path for path, command in reads
               if not any("--json" in param.opts for param in command.params)]
    assert not missing, missing


def test_every_option_and_argument_says_what_it_is() -> None:
    """Each visible option and argument of every command has help text of its own (a bare
    `--rank INTEGER` tells a user nothing)."""
    bare = [f"appliance {path}: {param.name}" for path, command, _ in commands() for param in command.params
            if not getattr(param, "hidden", False) and not (getattr(param, "help", None) or "").strip()]
    assert not bare, f"give these help: {bare}"


def test_usage_lines_name_arguments_plainly() -> None:
    """`Usage: appliance users add [OPTIONS] NAME`, never `{NAME}` (Typer's braces for a required
    argument, read as a choice or a placeholder to type braces and all)."""
    runner, braced, arguments = CliRunner(), [], 0
    for path, command, _ in commands():
        shown = runner.invoke(cli.app, [*path.split(), "--help"], env={"COLUMNS": "300"})
        [usage] = [line.strip() for line in shown.output.splitlines() if line.strip().startswith("Usage:")]
        if re.search(r"[{}]", usage):
            braced.append(usage)
        for param in command.params:
            if param.param_type_name == "argument" and not param.hidden:
                arguments += 1
                name = (param.metavar or "") + ("..." if param.nargs != 1 else "")
                assert (name if param.required else f"[{name}]") in usage.split(), (usage, param.name)
    assert arguments > 20, "the walk found the commands' arguments"
    assert not braced, braced


@pytest.mark.parametrize("path", sorted({path for path, _, _ in commands()} | {""}))
def test_help_names_no_types_and_breaks_no_sentence(path: str) -> None:
    shown = CliRunner().invoke(cli.app, [*path.split(), "--help"], env={"COLUMNS": "300"})
    assert shown.exit_code == 0, shown.output
    labels = [label for label in TYPE_LABELS if label in shown.output]
    assert not labels, f"`appliance {path} --help` shows {labels}"
    # At 300 columns every help line fits: a row of a table going on in lower case below its first
    # line continues a sentence its source broke.
    continued = [line for line in shown.output.splitlines() if re.match(r"│ {3,}[a-z]", line)]
    assert not continued, continued


def test_old_spellings_still_run_and_say_what_they_are_now(monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.commands import serving

    calls: list[tuple[str, str]] = []

    def admin_api(method: str, path: str, **_: object) -> dict[str, object]:
        calls.append((method, path))
        return {"id": "batch_1", "status": "cancelling", "flushed": 3, "data": []}

    monkeypatch.setattr(serving, "admin_api", admin_api)
    runner = CliRunner()
    for old, new in ((["serving", "cancel-batch", "batch_1"], "serving batches cancel"),
                     (["serving", "flush-cache"], "serving cache flush"),
                     (["serving", "batches", "--limit", "5"], "serving batches list")):
        ran = runner.invoke(cli.app, old)
        assert ran.exit_code == 0, ran.output
        assert f"is now `appliance {new}`" in ran.stderr
    assert calls == [("POST", "/batches/batch_1/cancel"), ("POST", "/cache/flush"), ("GET", "/batches")]
    path = runner.invoke(cli.app, ["settings", "path"])
    assert path.exit_code == 0 and path.stdout == runner.invoke(cli.app, ["settings", "show", "--path"]).stdout
