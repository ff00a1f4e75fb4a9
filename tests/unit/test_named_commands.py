"""Every `appliance ...` command the product names to its users, in its messages, help and
hints (string literals of the packages), is a command of the CLI, with the options it names:
a hint to run a command that does not exist sends the user nowhere. The docs are held to the same
by tests/unit/test_docs.py, whose check this reuses."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.unit.test_docs import CODE_SPAN, INVOCATION, ROOT, _problem, _root_command

PACKAGES = ("appliance", "audit", "serve", "finetune", "installer", "tui")
# What an f-string's replacement field reads as: "the rest is not spelled out" (the check stops
# there: the field may be a command's name as well as an argument's value).
FIELD = "..."


def _literal_text(node: ast.Constant | ast.JoinedStr) -> str:
    """A string literal's text; an f-string's replacement fields as FIELD."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    return "".join(str(part.value) if isinstance(part, ast.Constant) else FIELD for part in node.values)


def _literals(source: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every string literal in `source`, an f-string read whole (not its parts)."""
    tree = ast.parse(source.read_text(), filename=str(source))
    parts = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)
                                               and id(node) not in parts):
            yield node.lineno, _literal_text(node)


def named_commands(source: Path) -> Iterator[tuple[int, str]]:
    """(line, the text after `appliance`) of each command a string literal of `source` quotes."""
    for line, text in _literals(source):
        for span in CODE_SPAN.findall(text):
            for match in INVOCATION.finditer(span):
                yield line, match.group(1)


def test_every_command_the_product_names_exists() -> None:
    root = _root_command()
    sources = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))
    found = [(source, line, quoted) for source in sources for line, quoted in named_commands(source)]
    assert len(found) > 50, "the walk finds the commands the messages name"
    problems = [f"{source.relative_to(ROOT)}:{line}: `appliance{quoted}`: {problem}"
                for source, line, quoted in found if (problem := _problem(root, quoted)) is not None]
    assert not problems, "\n".join(problems)


def test_the_walk_reads_f_strings_whole_and_catches_a_command_that_is_not_there(tmp_path: Path) -> None:
    source = tmp_path / "messages.py"
    source.write_text('name = "x"\n'
                      'HINT = ("API keys cannot use the admin API; log in with "\n'
                      '        "`appliance login` (or use a Keycloak token)")\n'
                      'DEPLOY = f"deploy one with `appliance adapters deploy {name}`"\n'
                      'WRONG = f"`appliance adapters deploy {name} --colour blue`"\n')
    found = list(named_commands(source))
    assert found == [(2, " login"), (4, " adapters deploy ..."), (5, " adapters deploy ... --colour blue")]
    root = _root_command()
    assert [_problem(root, quoted) for _, quoted in found] == ["`appliance` has no command 'login'", None, None]
