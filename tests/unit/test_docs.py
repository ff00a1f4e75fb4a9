"""The documentation stays true to the tree: every relative link resolves (to a heading too, where
it names one), every source file it quotes exists, every `appliance ...` command it quotes exists
with the options it quotes, and the design's module table names every module of the packages and
nothing else."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from appliance import cli
from bench import house

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md",
               *(ROOT / "docs").rglob("*.md")])
PACKAGES = ("appliance", "audit", "serve", "finetune", "installer", "tui")
MODULE_TABLE = ROOT / "docs" / "design" / "architecture.md"

FENCE = re.compile(r"^```(\S*)\n(.*?)^```", re.M | re.S)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.M)
# `appliance` as a command: at the start, after a space, or as the last part of a path
# (.venv/bin/appliance); never part of a name (appliance-train, appliance.programs, /var/lib/appliance).
INVOCATION = re.compile(r"(?:^|(?<=\s)|(?<=bin/))appliance((?:[ \t]+\S+)+)")
SHELL_FENCES = {"", "sh", "bash", "shell", "console"}
ENDS_A_COMMAND = {"|", ">", ">>", "<", "&&", "||", ";", "2>", "2>&1"}


def _relative(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text with code blocks and code spans blanked out: links are only read from prose."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    return {_slug(heading) for heading in HEADING.findall(FENCE.sub("", doc.read_text()))}


def _links() -> Iterator[tuple[Path, str]]:
    for doc in DOCS:
        for target in LINK.findall(_prose(doc.read_text())):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not ours
                yield doc, target


@pytest.mark.parametrize("doc", DOCS, ids=_relative)
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for source, target in _links():
        if source != doc:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {_relative(file)}")
    assert not broken, f"{_relative(doc)}: " + "; ".join(broken)


def _quoted_commands(doc: Path) -> Iterator[str]:
    """The text after `appliance` of each command the doc quotes, in shell blocks or code spans."""
    text = doc.read_text()
    lines: list[str] = []
    for language, body in FENCE.findall(text):
        if language in SHELL_FENCES:
            lines.extend(line.split(" #")[0] for line in body.splitlines() if not line.lstrip().startswith("#"))
    lines.extend(CODE_SPAN.findall(FENCE.sub("", text)))
    for line in lines:
        for match in INVOCATION.finditer(line):
            yield match.group(1)


def _root_command() -> Any:
    return typer.main.get_command(cli.app)


def _context(command: Any, name: str, parent: Any = None) -> Any:
    # resilient_parsing: an unknown command resolves to None instead of failing the context
    return typer.Context(command, info_name=name, parent=parent, resilient_parsing=True)


def _option_names(command: Any) -> set[str]:
    names = {"--help"}
    for parameter in command.params:
        if parameter.param_type_name == "option":
            names.update(parameter.opts, parameter.secondary_opts)
    return names


def _problem(root: Any, quoted: str) -> str | None:
    """Why `appliance <quoted>` is not a command of the CLI, or None when it is. Subcommands are
    found as the CLI finds them to run them (each group's `resolve_command`), so commands the root
    loads only when they run are found whole, with their options and subcommands."""
    command, context, path = root, _context(root, "appliance"), ["appliance"]
    for raw in quoted.split():
        if raw in ENDS_A_COMMAND:
            break
        word = raw.strip("[]")
        if word == "...":  # "and so on": the rest is not spelled out
            break
        if word.startswith("-") and not re.fullmatch(r"-[\d.]+", word):
            option = word.split("=")[0]
            if option not in _option_names(command):
                return f"`{' '.join(path)}` has no option {option}"
        elif hasattr(command, "resolve_command"):  # a group: the word must name one of its commands
            _, sub, _ = command.resolve_command(context, [word])
            if sub is None:
                return f"`{' '.join(path)}` has no command {word!r}"
            command, path = sub, [*path, word]
            context = _context(command, word, context)
    return None


def test_every_quoted_appliance_command_exists() -> None:
    root = _root_command()
    problems = [f"{_relative(doc)}: appliance{quoted.rstrip()}: {problem}"
                for doc in DOCS for quoted in _quoted_commands(doc)
                if (problem := _problem(root, quoted)) is not None]
    assert not problems, "\n".join(problems)


def test_the_command_check_catches_what_is_not_there() -> None:
    root = _root_command()
    assert _problem(root, " users add alice --role user") is None
    assert _problem(root, " -v rl tasks add-starter [--name N]") is None
    assert _problem(root, " users purge alice") is not None
    assert _problem(root, " users add alice --colour blue") is not None


SOURCE_PATH = re.compile(r"(?:appliance|audit|serve|finetune|installer|tui|bench|tests)/[\w/*.-]*\.(?:py|sh)")


@pytest.mark.parametrize("doc", [doc for doc in DOCS if doc.name != "CHANGELOG.md"], ids=_relative)
def test_every_quoted_source_file_exists(doc: Path) -> None:
    """A module, test or bench named in a code span (`serve/upstream.py`, `tests/unit/test_x*.py`)
    is in the tree: a module moved by a refactor leaves no stale name behind. (The changelog may
    name files that are gone, and so may the design docs' size table: it names the largest file of
    the commits it measured, which tests/unit/test_house_doc.py measures again.)"""
    text = house.DOC_TABLE.sub("", doc.read_text())
    quoted = {span for span in CODE_SPAN.findall(FENCE.sub("", text)) if SOURCE_PATH.fullmatch(span)}
    missing = sorted(path for path in quoted if not any(ROOT.glob(path)))
    assert not missing, f"{_relative(doc)} names files that are not in the tree: {missing}"


def _named_modules() -> list[str]:
    """Module paths named in the first column of the design's module tables."""
    return re.findall(r"^\|\s*`([\w/]+\.py)`\s*\|", MODULE_TABLE.read_text(), re.M)


def test_the_module_table_names_every_module_once() -> None:
    named = _named_modules()
    present = {str(path.relative_to(ROOT)) for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    twice = sorted({module for module in named if named.count(module) > 1})
    gone, unnamed = sorted(set(named) - present), sorted(present - set(named))
    assert not twice, f"named twice: {twice}"
    assert not gone, f"named but not in the tree: {gone}"
    assert not unnamed, f"in the tree but not named: {unnamed}"
