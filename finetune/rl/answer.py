"""The answer's side of a function test (finetune/rl/harness.py starts it, a fresh interpreter, in
the execution sandbox): it runs the untrusted program, then calls its functions as the harness asks
and sends back what they returned, as plain data (finetune/rl/plain.py). It holds only the two
pipes given on its command line: the tests, their expected values and the harness's result
descriptor are in another process it cannot read.

Protocol, one JSON line each way: first {"functions": [names]} (or {"failed": why} if the program
did not load); then for each {"call": name, "args": ..., "kwargs": ...} an {"value": ...} or
{"raised": exception class name, "message": ...}.
"""

import json
import os
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


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
