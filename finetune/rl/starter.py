"""A starter task set: twenty small Python functions in HumanEval's shape (a signature and docstring
to complete, a `check(candidate)`), for checking a deployment's loop end to end in minutes
(`appliance rl tasks starter`); a small model solves many of them, so a run yields passing and
failing attempts, corrections, and SFT and preference data."""

from __future__ import annotations

from appliance.rl.tasks import Task

FUNCTIONS: list[tuple[str, str, str, list[str]]] = [
    ("add", "a: int, b: int", "Return the sum of a and b.", ["(1, 2) == 3", "(-1, 1) == 0"]),
    ("subtract", "a: int, b: int", "Return a minus b.", ["(5, 3) == 2", "(0, 4) == -4"]),
    ("multiply", "a: int, b: int", "Return the product of a and b.", ["(3, 4) == 12", "(0, 9) == 0"]),
    ("square", "x: int", "Return x squared.", ["(3) == 9", "(-2) == 4"]),
    ("double", "x: int", "Return twice x.", ["(4) == 8", "(0) == 0"]),
    ("increment", "x: int", "Return x plus one.", ["(1) == 2", "(-1) == 0"]),
    ("negate", "x: int", "Return the negative of x.", ["(5) == -5", "(-3) == 3"]),
    ("is_even", "n: int", "Return True if n is even, else False.", ["(4) is True", "(7) is False"]),
    ("maximum", "a: int, b: int", "Return the larger of a and b.", ["(1, 2) == 2", "(9, 3) == 9"]),
    ("minimum", "a: int, b: int", "Return the smaller of a and b.", ["(1, 2) == 1", "(9, 3) == 3"]),
    ("absolute", "x: int", "Return the absolute value of x.", ["(-4) == 4", "(3) == 3"]),
    ("first", "items: list", "Return the first element of items.", ["([1, 2, 3]) == 1", "(['a']) == 'a'"]),
    ("last", "items: list", "Return the last element of items.", ["([1, 2, 3]) == 3", "(['a']) == 'a'"]),
    ("length", "items: list", "Return the number of elements in items.", ["([1, 2, 3]) == 3", "([]) == 0"]),
    ("total", "items: list", "Return the sum of the numbers in items.", ["([1, 2, 3]) == 6", "([]) == 0"]),
    ("reverse", "text: str", "Return text reversed.", ["('abc') == 'cba'", "('') == ''"]),
    ("upper", "text: str", "Return text in upper case.", ["('abc') == 'ABC'", "('A1') == 'A1'"]),
    ("concat", "a: str, b: str", "Return a followed by b.", ["('ab', 'cd') == 'abcd'", "('', 'x') == 'x'"]),
    ("identity", "x: int", "Return x unchanged.", ["(7) == 7", "(0) == 0"]),
    ("halve", "x: int", "Return x divided by two, rounded down.", ["(9) == 4", "(8) == 4"]),
]


def starter_tasks() -> list[Task]:
    tasks = []
    for name, arguments, doc, checks in FUNCTIONS:
        tests = "def check(candidate):\n" + "".join(f"    assert candidate{check}\n" for check in checks)
        tasks.append(Task(id=f"starter/{name}", prompt=f'def {name}({arguments}):\n    """{doc}"""\n', tests=tests,
                          entry_point=name, time_limit_s=5))
    return tasks
