"""A repository task small enough to solve by hand (calc's add subtracts), shared by the episode
tests and bench.agentic, and the calls the demo model is made to write on it through the gateway."""

from __future__ import annotations

from appliance.rl.tasks import RepositoryTask

CODE = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
TESTS = ("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
         "def test_zero():\n    assert add(0, 0) == 0\n")
CALC_TASK = RepositoryTask(id="calc-add", instruction="The tests of calc fail: fix calc/__init__.py.",
                           files={"calc/__init__.py": CODE, "tests/test_calc.py": TESTS, "README.md": "calc\n"},
                           tests=["tests/test_calc.py"])
# Calls the demo model is made to write (structured output, in the hermes parser's form): vLLM
# 0.32 leaves its arguments a string, or writes none, under tool_choice "required".
CALLS = (r'<tool_call>\n\{"name": "(list_files|run_tests|submit)", "arguments": \{\}\}\n</tool_call>'
         r'|<tool_call>\n\{"name": "read_file", "arguments": '
         r'\{"path": "(calc/__init__\.py|README\.md)"\}\}\n</tool_call>')
