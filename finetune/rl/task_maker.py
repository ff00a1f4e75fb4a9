"""Repository tasks made from real code, offline (`appliance rl tasks make`): a package's function
that its own tests call is given one bug (finetune.rl.mutations), and the task is kept only if, in
the execution sandbox, the tests that call it pass on the code as it was and at least one fails
with the bug. The agent then gets the package with the bug and those tests.

A source is an installed package (its directory, with its tests inside it: mpmath's
mpmath/tests, say) or a repository's directory: its Python files and, as tests, the top-level
`def test*` functions of its test_*.py or *_test.py files (plain asserts; the sandbox's runner has
no pytest fixtures). A function counts as called by a test when the test's body names it."""

from __future__ import annotations

import ast
import importlib.util
import os
import random
import re
import stat
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from appliance.errors import Invalid
from appliance.rl.tasks import MAX_FILES, MAX_REPOSITORY_BYTES, RepositoryTask, relative_path
from appliance.settings import ExecutionSettings, RlSettings
from finetune.rl.execute import Sandbox, Verdict
from finetune.rl.mutations import Mutation, Site, apply, sites

MAX_SOURCE_FILE = 1 << 20  # a source file larger than this is left out
TESTS_A_TASK = 6  # test functions a task's test file keeps, at most
SKIPPED_PARTS = {"__pycache__", "build", "dist", "node_modules", "site-packages"}


@dataclass
class Source:
    """Where tasks are made from: `files` (relative path: text) and which of them hold tests."""

    name: str
    files: dict[str, str]
    tests: list[str]


@dataclass
class Made:
    tasks: list[RepositoryTask] = field(default_factory=list)
    tried: int = 0  # mutations validated
    equivalent: int = 0  # no test failed with the bug
    unsound: int = 0  # the tests failed without it too (slow, flaky, or needing what is not there)
    seconds: float = 0.0
    validation_s: float = 0.0  # in the sandbox


def source_of(origin: str) -> Source:
    """An installed package by name, or a directory; Invalid naming what is wrong."""
    if not origin.strip():
        raise Invalid("--from is empty: an installed package's name or a directory")
    directory = Path(origin)
    if directory.is_dir():
        return _read(directory.resolve(), directory.resolve(), directory.resolve().name or "root")
    if "/" in origin or origin.startswith("."):
        raise Invalid(f"--from {origin[:200]!r}: no such directory")
    try:
        spec = importlib.util.find_spec(origin) if origin.isidentifier() else None
    except (ImportError, ValueError):  # __main__, say, has no spec
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise Invalid(f"--from {origin[:200]!r}: neither a directory nor an installed package (a directory of "
                      "modules)", hint="an installed pure-Python package with its tests, mpmath say, or a directory")
    package = Path(next(iter(spec.submodule_search_locations))).resolve()
    return _read(package.parent, package, origin)


def _read(root: Path, top: Path, name: str) -> Source:
    """The Python files under `top`, by their paths from `root`: regular files only, each opened
    without following a link (one swapped in after the walk is refused by the open), at most
    MAX_SOURCE_FILE each; Invalid as soon as they are more than a task may carry. Directories that
    cannot be listed, or vanish, are passed over."""
    files: dict[str, str] = {}
    total = 0
    # fwalk: each directory opened without following a link, and each file opened relative to it,
    # so neither a file nor a directory above it swapped for a link after the walk leads elsewhere.
    for directory, dirs, names, directory_fd in os.fwalk(top):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_PARTS and not d.startswith("."))
        for file_name in sorted(n for n in names if n.endswith(".py")):
            relative = (Path(directory) / file_name).relative_to(root).as_posix()
            try:
                relative_path(relative)
            except ValueError:
                continue  # a name a task cannot carry: left out
            text = _read_file(file_name, directory_fd)
            if text is None:
                continue
            files[relative] = text
            total += len(text.encode("utf-8"))
            if len(files) >= MAX_FILES or total > MAX_REPOSITORY_BYTES:
                raise Invalid(f"--from {name[:200]!r}: more Python files than a task may carry ({MAX_FILES - 1} "
                              f"files, {MAX_REPOSITORY_BYTES:,} bytes)", hint="a smaller package or directory")
    tests = [path for path in files if _is_test(path)]
    if not tests:
        raise Invalid(f"--from {name[:200]!r}: no test files (test_*.py or *_test.py) among its {len(files)} "
                      "Python files")
    return Source(name, files, tests)


def _read_file(name: str, directory_fd: int) -> str | None:
    """A regular file's UTF-8 text (not through a link, not a FIFO or device, at most
    MAX_SOURCE_FILE); None for anything else. A hard link is read (uv installs packages as hard
    links to its cache; the kernel's protected_hardlinks keeps a user from linking what they
    could not read)."""
    try:
        descriptor = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory_fd)
    except OSError:
        return None
    try:
        found = os.fstat(descriptor)
        if not stat.S_ISREG(found.st_mode) or found.st_size > MAX_SOURCE_FILE:
            return None
        data = os.read(descriptor, MAX_SOURCE_FILE + 1)
        return data.decode("utf-8") if len(data) <= MAX_SOURCE_FILE else None
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(descriptor)


def _is_test(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith("test_") or name.endswith("_test.py")


def callers(source: Source) -> dict[str, dict[str, list[str]]]:
    """For each name a test's body uses: the test files and their test functions using it. A test
    file importing what is neither the standard library's nor the source's (pytest, say: the
    sandbox's runner has only the system's Python) is left out."""
    found: dict[str, dict[str, list[str]]] = {}
    own = {path.split("/", 1)[0].removesuffix(".py") for path in source.files}
    for path in source.tests:
        try:
            tree = ast.parse(source.files[path])
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        imported = {alias.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        if imported - own - set(sys.stdlib_module_names):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test") and not node.args.args:
                used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                used |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                for name in used:
                    found.setdefault(name, {}).setdefault(path, []).append(node.name)
    return found


def focused(text: str, keep: list[str]) -> str:
    """A test file with only the test functions in `keep` (its imports and helpers stay)."""
    tree = ast.parse(text)  # parsed before, by callers
    lines = text.splitlines(keepends=True)
    dropped: set[int] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test") \
                and node.name not in keep:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            dropped.update(range(first - 1, (node.end_lineno or node.lineno)))
    return "".join(line for number, line in enumerate(lines) if number not in dropped)


def candidates(source: Source, seed: int) -> Iterator[tuple[Mutation, str, list[str]]]:
    """One mutation of each function some test calls (chosen with `seed`), with the test file that
    calls it most and its tests that do, in a random order; a file is rewritten only for the
    mutation chosen."""
    chooser = random.Random(seed)
    called = callers(source)
    places: list[tuple[str, list[Site], str, list[str]]] = []
    for path, text in source.files.items():
        if _is_test(path) or "/tests/" in f"/{path}":
            continue
        by_function: dict[str, list[Site]] = {}
        for site in sites(text):
            by_function.setdefault(site.function, []).append(site)
        for function, found in by_function.items():
            short = function.rsplit(".", 1)[-1]
            users = called.get(short, {})
            if users and not short.startswith("__"):
                test_file = max(sorted(users), key=lambda p: len(users[p]))
                places.append((path, found, test_file, sorted(users[test_file])[:TESTS_A_TASK]))
    chooser.shuffle(places)
    for path, found, test_file, tests in places:
        for site in chooser.sample(found, len(found)):  # the first that can be written
            mutation = apply(path, source.files[path], site)
            if mutation is not None:
                yield mutation, test_file, tests
                break


def make(source: Source, limit: int, seed: int, execution: ExecutionSettings, rl: RlSettings,
         progress: Callable[[Made], None] = lambda made: None, max_tried: int | None = None) -> Made:
    """Up to `limit` tasks, each validated in the sandbox: the tests pass without the bug and fail
    with it. `progress` is told after each validation."""
    started = time.monotonic()
    made = Made()
    sound: dict[tuple[str, tuple[str, ...]], bool] = {}  # the tests pass on the code as it was
    common = {path: text for path, text in source.files.items() if not _is_test(path)}
    if sum(len(t.encode()) for t in common.values()) > MAX_REPOSITORY_BYTES or len(common) >= MAX_FILES:
        raise Invalid(f"--from {source.name!r}: its {len(common)} files are more than a task may carry "
                      f"({MAX_FILES - 1} files, {MAX_REPOSITORY_BYTES:,} bytes)")
    for mutation, test_file, tests in candidates(source, seed):
        if len(made.tasks) >= limit or (max_tried is not None and made.tried + made.unsound >= max_tried):
            break
        test_text = focused(source.files[test_file], tests)
        key = (test_file, tuple(tests))
        if key not in sound:
            before = _validate(common | {test_file: test_text}, test_file, execution, rl, made)
            sound[key] = before.tests_total == len(tests) and before.tests_passed == len(tests)
        if not sound[key]:
            made.unsound += 1
            continue
        files = common | {mutation.path: mutation.text, test_file: test_text}
        try:
            RepositoryTask(id="x", instruction="x", files=files, tests=[test_file])  # what a task may carry
        except ValidationError as exc:
            raise Invalid(f"--from {source.name!r}: a task of it cannot be made: {exc.errors()[0]['msg']}") from exc
        after = _validate(files, test_file, execution, rl, made)
        made.tried += 1
        if after.tests_passed == after.tests_total:
            made.equivalent += 1
        else:
            failing = next(t for t in after.tests if not t.passed)
            made.tasks.append(RepositoryTask(
                id=f"{_id_part(source.name, 60)}-{len(made.tasks) + 1}-{_id_part(mutation.function, 120)}",
                instruction=(f"A test of {source.name} fails: {failing.test}: {failing.reason[:300]}. "
                             f"The bug is in the code, not in the tests: find it and fix it, then run the tests."),
                files=files, tests=[test_file]))
        progress(made)
    made.seconds = round(time.monotonic() - started, 3)
    return made


def _id_part(text: str, most: int) -> str:
    """Text fit for a task's id (printable ASCII, no space), at most `most` characters."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:most] or "_"


def _validate(files: dict[str, str], test_file: str, execution: ExecutionSettings, rl: RlSettings,
              made: Made) -> Verdict:
    """The test file's tests on these files, in a sandbox of their own."""
    started = time.monotonic()
    with Sandbox(execution, workspace_mib=rl.workspace_mib) as sandbox:
        seeded = sandbox.act("seed", files=files)
        verdict = seeded if seeded.status != "passed" else sandbox.act("check", files={test_file: files[test_file]})
    made.validation_s += time.monotonic() - started
    return verdict
