"""The answer's side of a function test, in the execution sandbox: it runs the untrusted program,
then calls its functions as the harness (finetune/rl/harness.py) asks and sends back what they
returned, as plain data (finetune/rl/plain.py). It holds only its two pipes: the tests, their
expected values and the harness's result descriptor are in another process it cannot read.

Each answer is a fork of the execution's answers' template (`serve_forks`), which the zygote forks
before the tests are read (so no answer's memory ever held them) and which never runs untrusted
code: an answer costs a fork, not an interpreter's start and imports.

Protocol, one JSON line each way: first {"functions": [names]} (or {"failed": why} if the program
did not load); then for each {"call": name, "args": ..., "kwargs": ...} an {"value": ...} or
{"raised": exception class name, "message": ...}.
"""

import json
import os
import signal
import socket
import sys
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plain  # type: ignore[import-not-found]  # bound next to this file in the cell

PROGRAM = "/task/program.py"


def main(requests_fd: int, answers_fd: int) -> None:
    requests, answers = os.fdopen(requests_fd, "rb"), os.fdopen(answers_fd, "wb")

    def send(message: dict[str, Any]) -> None:
        for stream in (sys.stdout, sys.stderr):  # what it printed is kept: it ends once the harness has its answer
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        answers.write(json.dumps(message).encode() + b"\n")
        answers.flush()

    scope: dict[str, Any] = {"__name__": "__sandbox__"}
    try:
        with open(PROGRAM) as source:
            exec(compile(source.read(), "program.py", "exec"), scope)
    except BaseException as exc:  # SystemExit included: the program left before it was asked anything
        traceback.print_exc()
        send({"failed": f"the program did not load: {type(exc).__name__}: {str(exc)[:200]}"})
        return
    send({"functions": sorted(name for name, value in scope.items() if callable(value) and not name.startswith("_"))})
    for line in requests:
        request = json.loads(line)
        try:
            function = scope[request["call"]]
            value = function(*plain.decode(request["args"]), **plain.decode(request["kwargs"]))
            reply = {"value": plain.encode(value)}
        except plain.NotPlain as exc:
            reply = {"raised": "NotPlain", "message": f"{request['call']} returned {exc}"}
        except BaseException as exc:  # what the function raised goes back for the test to judge
            reply = {"raised": type(exc).__name__, "message": str(exc)[:500]}
        send(reply)


def serve_forks(control: socket.socket) -> None:
    """The answers' template, until the harness closes `control`: for each b"start", an answer
    forked with two new pipes (its pid and the pipes' other ends go to the harness); for each
    b"end", that answer's process group killed and its exit status sent back; on b"last" (the last
    test's), it becomes that answer itself (one fork fewer: the harness, its parent, reaps it)."""
    answer = 0
    while True:
        message = control.recv(16)
        if message == b"end" and answer:
            for kill, target in ((os.killpg, answer), (os.kill, answer)):
                try:
                    kill(target, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            _, status = os.waitpid(answer, 0)
            answer = 0
            control.sendall(str(os.waitstatus_to_exitcode(status)).encode())
            continue
        if message not in (b"start", b"last") or answer:
            return  # the harness closed it, or broke the protocol: its answers fail from here on
        requests_read, requests_write = os.pipe()
        answers_read, answers_write = os.pipe()
        answer = os.getpid() if message == b"last" else os.fork()
        if answer == 0 or message == b"last":
            if message == b"last":
                socket.send_fds(control, [str(answer).encode()], [requests_write, answers_read])
            control.close()
            os.close(requests_write)
            os.close(answers_read)
            run_forked(requests_read, answers_write)
        try:
            os.setpgid(answer, answer)  # as the child does: its group exists before the harness may end it
        except OSError:  # the child got there first, or already ended
            pass
        for fd in (requests_read, answers_write):
            os.close(fd)
        socket.send_fds(control, [str(answer).encode()], [requests_write, answers_read])
        for fd in (requests_write, answers_read):
            os.close(fd)


def run_forked(requests_fd: int, answers_fd: int) -> None:
    """In a forked answer: what a fresh interpreter would have (its own process group, default
    signals, /tmp, a bare environment, no bytecode written), then `main`; it never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the zygote's process 1 ignores it
        os.chdir("/tmp")
        os.environ.clear()
        os.environ["LANG"] = "C.UTF-8"
        sys.dont_write_bytecode = True
        sys.argv = [PROGRAM]
        main(requests_fd, answers_fd)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
