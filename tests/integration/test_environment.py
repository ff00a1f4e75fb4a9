"""Agent episodes on a repository task, in the execution sandbox (bubblewrap, as root here) with a
workspace kept for the episode: through the real gateway and vLLM as the RL service identity,
an episode runs to its end, each answer's calls are audited in order, and its record replays to
the same final workspace; without a model, the tools do what they say, the task's tests decide
the reward whatever the agent did to them, hostile calls (leaving the workspace, the network,
the host's secrets, a fork bomb, a full disk, a memory bomb) are contained and score nothing,
and a flood of calls stops at the episode's budget."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from appliance.rl.episodes import Episode
from appliance.settings import ExecutionSettings, RlSettings
from audit.writer import log_files
from finetune.rl.environment import Call, WorkspaceEnvironment
from tests.integration.conftest import Running
from tests.support.appliances import APPLIANCE
from tests.support.repository_tasks import CALC_TASK, CALLS, FIXED
from tests.support.waiting import until

MODEL = "SmolLM2-135M-Instruct"
TASK = CALC_TASK
RL = RlSettings(episode_tool_calls=12, workspace_mib=8)


def write(path: str, text: str, call: str = "w") -> Call:
    return Call(call, "write_file", json.dumps({"path": path, "content": text}))


def shell(command: str, call: str = "s") -> Call:
    return Call(call, "shell", json.dumps({"command": command}))


def episode(*answers: list[Call], rl: RlSettings = RL) -> tuple[WorkspaceEnvironment, list]:
    """The environment after these answers (each a list of calls), and each step's result."""
    env = WorkspaceEnvironment(TASK, ExecutionSettings(), rl)
    env.reset()
    return env, [env.step(calls, 10) for calls in answers]


@pytest.mark.integration
def test_the_tools_act_on_the_workspace_and_the_task_s_tests_decide_the_reward() -> None:
    env, [first, last] = episode(
        [Call("l", "list_files", "{}"), Call("r", "read_file", '{"path": "calc/__init__.py"}'),
         Call("f", "search", '{"text": "add("}'), Call("t", "run_tests", "{}"), write("calc/__init__.py", FIXED),
         Call("t2", "run_tests", "{}")],
        [Call("done", "submit", "{}")])
    with env:
        listing, read, found, failing, wrote, passing = (step.output for step in first.tools)
        assert listing.split() == ["calc/", "tests/", "README.md", "calc/__init__.py", "tests/test_calc.py"]
        assert read == "1: def add(a, b):\n2:     return a - b\n"
        assert "calc/__init__.py:1: def add(a, b):" in found
        assert "tests/test_calc.py:5:     assert add(2, 3) == 5" in found
        assert failing.startswith("1 of 2 tests passed\nFAILED tests/test_calc.py::test_add: AssertionError")
        assert wrote.startswith("wrote 32 bytes") and passing == "2 of 2 tests passed"
        assert not first.done and last.done and last.ended == "submitted" and last.reward == 1.0
        assert (last.tests_passed, last.tests_total) == (2, 2) and last.workspace_sha256
        # The same calls in a fresh workspace leave the same one.
        again = env.replay([*first.tools, *last.tools])
        assert again.workspace_sha256 == last.workspace_sha256 and again.reward == 1.0


@pytest.mark.integration
@pytest.mark.parametrize("cheat", [
    [write("tests/test_calc.py", "def test_add():\n    pass\n")],  # the tests rewritten
    [shell("rm -rf tests && ln -s /tmp tests")],  # a link where the tests go
    [shell("rm tests/test_calc.py && mkdir tests/test_calc.py")],  # a directory where one goes
    [write("calc/__init__.py", "import os\nos._exit(0)\n")],  # the test's process ends as if it passed
    [write("calc/__init__.py", "import sys\nsys.exit(0)\n")],
    [write("calc/__init__.py", "print('x' * 64)\nimport os\nos._exit(0)\n")],
    [write("traceback.py", "def print_exc():\n    pass\n"), write("calc/__init__.py", "raise SystemExit(0)\n")],
    # A planted bytecode file: as old as a file the check restores, the same size.
    [shell("python3 -c \"import py_compile; py_compile.compile('calc/__init__.py')\"; "
           "printf 'def add(a, b):\\n    return a + b\\n' > /tmp/x.py")],
    # Tests of the agent's own: the check runs the task's only.
    [write("test_aaa.py", "def test_a():\n    pass\n" * 3), write("tests/test_more.py", "def test_b():\n    pass\n")],
    # The nonce looked for where it used to be: the environment, the runner's globals.
    [write("calc/__init__.py", "import os, sys\nprint(os.environ.get('TEST_NONCE'), "
                               "getattr(sys.modules['__main__'], 'nonce', None))\nos._exit(0)\n")],
])
def test_what_the_agent_does_to_the_tests_or_the_runner_earns_nothing(cheat: list[Call]) -> None:
    env, [result] = episode([*cheat, Call("done", "submit", "{}")])
    with env:
        assert result.ended == "submitted" and result.reward < 1.0, result.reason


@pytest.mark.integration
def test_nothing_one_test_leaves_running_or_cached_reaches_the_next() -> None:
    """The code under test, imported by the first test, starts a process of its own session that
    would fix the code while the second test waits, and plants the second test file's bytecode
    (both passing): each test runs alone, in a cache of its own."""
    sneaky = ("import os, subprocess, py_compile\n"
              "if not os.path.exists('/tmp/once'):\n"
              "    open('/tmp/once', 'w').close()\n"
              "    subprocess.Popen(['/bin/sh', '-c', 'sleep 0.7; printf \"def add(a, b):\\\\n    return a + b\\\\n\" "
              "> calc/__init__.py'], start_new_session=True)\n"
              "    for prefix in [p for p in os.listdir('/tmp') if p.startswith('pycache')]:\n"
              "        py_compile.compile('tests/test_calc.py', cfile='/tmp/' + prefix + '/workspace/tests/'\n"
              "                           'test_calc.cpython-311.pyc')\n"
              "def add(a, b):\n    return a - b\n")
    ordered = ("def test_zero():\n    from calc import add\n    assert add(0, 0) == 0\n\n\n"
               "def test_add():\n    import time\n    time.sleep(1.5)\n    from calc import add\n"
               "    assert add(2, 3) == 5\n")
    task = TASK.model_copy(update={"files": {**TASK.files, "calc/__init__.py": sneaky, "tests/test_calc.py": ordered}})
    with WorkspaceEnvironment(task, ExecutionSettings(), RL) as env:
        env.reset()
        result = env.step([Call("done", "submit", "{}")], 1)
        assert result.reward == 0.5 and "test_add: AssertionError" in result.reason, result.reason


@pytest.mark.integration
def test_hostile_calls_are_contained(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    secret.chmod(0o600)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        env, [result] = episode([
            Call("a", "read_file", json.dumps({"path": "../../etc/passwd"})),
            Call("b", "read_file", json.dumps({"path": "/etc/passwd"})),
            shell("ln -s /etc out"), Call("c", "read_file", json.dumps({"path": "out/passwd"})),
            write("out/evil", "x"),
            shell(f"cat {secret}; cat /proc/1/environ; ls /var/lib/appliance"),
            shell(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2)\""),
            Call("d", "read_file", json.dumps({"path": "a" * 5000})),
            Call("e", "read_file", json.dumps({"path": "a" * 70_000})),
            Call("f", "read_file", "[" * 5000),  # JSON nested past what the parser takes
            shell("mkfifo fifo"), write("fifo", "x"),  # a file that is not one
            write("a/" * 40 + "f", "x"),
        ], rl=RL.model_copy(update={"episode_tool_calls": 32}))
    with env:
        outputs = [step.output for step in result.tools]
        assert all(not result.tools[i].ok for i in (0, 1, 3, 4, 5, 6, 7, 8, 9, 11, 12)), outputs
        assert "leads out of the workspace" in outputs[3] and "leads out of the workspace" in outputs[4]
        assert "s3cret" not in outputs[5] and "No such file" in outputs[5]
        assert "ConnectionRefusedError" in outputs[6] or "Network is unreachable" in outputs[6]
        assert "at most 4096 characters" in outputs[7] and "over 65,536 characters" in outputs[8]
        assert "nested too deep" in outputs[9] and "is not a file" in outputs[11]
        assert "more than 32 parts" in outputs[12]


@pytest.mark.integration
@pytest.mark.parametrize("bomb", [
    ":(){ :|:& };:",  # processes: bounded by the sandbox's per-user limit
    "head -c 20000000 /dev/zero > big",  # the workspace's tmpfs is full
    "yes",  # output past its limit
    "python3 -c \"x = bytearray(1 << 34)\"",  # memory past the address-space limit
    "sleep 60",  # wall time past its limit
])
def test_exhausting_the_host_is_contained_and_earns_nothing(bomb: str) -> None:
    started = time.monotonic()
    env, [result] = episode([shell(bomb), Call("done", "submit", "{}")],
                            rl=RL.model_copy(update={"episode_wall_s": 120.0}))
    with env:
        assert result.done, result.reason
        if result.ended == "contained":  # the sandbox went over a limit: the workspace is gone, no reward
            assert result.reward == 0.0 and result.workspace_sha256 is None
        else:  # the call failed within its limits; the bug is still there
            assert result.ended == "submitted" and result.reward == 0.5, result.reason
        assert time.monotonic() - started < 90


@pytest.mark.integration
def test_a_tool_s_output_is_cut_before_the_sandbox_s_limit_and_the_digest_frames_its_fields() -> None:
    """A read or a search of large files prints at most 128 KiB (the sandbox ends an execution that
    prints 1 MiB); a link's target and a file's name never run together in the digest."""
    env, [result] = episode([shell("head -c 1500000 /dev/zero | tr '\\0' x > big; cp big big2"),
                             Call("r", "read_file", '{"path": "big"}'), Call("f", "search", '{"text": "x"}')])
    with env:
        assert not result.done and all(step.ok for step in result.tools), result.tools
        digests = []
        for links in ("ln -s xb a && echo > c", "ln -s x a && echo > bc"):
            env.reset()
            env.step([shell(f"rm -rf calc tests README.md && {links}")], 1)
            digests.append(env.workspace_sha256())
        assert digests[0] != digests[1]


@pytest.mark.integration
def test_a_flood_of_calls_stops_at_the_budget() -> None:
    started = time.monotonic()
    env, [result] = episode([Call(str(i), "list_files", "{}") for i in range(5000)])
    with env:
        assert result.done and result.ended == "tool_calls" and len(result.tools) == RL.episode_tool_calls
        assert "4988 calls of the last answer were not run" in result.reason
    assert time.monotonic() - started < 60
    env, results = episode(*[[Call(str(i), "list_files", "{}")] for i in range(3)],
                           rl=RL.model_copy(update={"episode_steps": 3}))
    with env:
        assert [r.done for r in results] == [False, False, True] and results[-1].ended == "steps"
    # Time spent waiting for answers counts too: an answer the gateway refused, after the wall time.
    env, _ = episode(rl=RL.model_copy(update={"episode_wall_s": 0.5}))
    with env:
        time.sleep(0.6)
        late = env.step([], 10, refused=True)
        assert late.done and late.ended == "wall_time"


def audit_records(running: Running, request_id: str) -> list[dict]:
    return [json.loads(line) for path in log_files(running.appliance.home.audit)
            for line in path.read_bytes().splitlines() if json.loads(line).get("request_id") == request_id]


@pytest.mark.integration
def test_an_episode_through_the_gateway_is_audited_and_replays_to_its_workspace(running: Running,
                                                                               tmp_path: Path) -> None:
    """The demo model, made to write calls the hermes parser reads (structured output, as vLLM 0.32
    leaves its arguments a string or writes none under tool_choice required), for three answers;
    its calls are checked by the gateway, run in the episode's sandbox, and audited under the RL
    service identity."""
    task, record = tmp_path / "task.json", tmp_path / "episode.json"
    task.write_text(TASK.model_dump_json())
    env = {**running.appliance.env, "APPLIANCE_RL__EPISODE_STEPS": "3", "APPLIANCE_RL__EPISODE_ANSWER_TOKENS": "96"}
    ran = subprocess.run([APPLIANCE, "rl", "episodes", "run", "--task", str(task), "--model", MODEL,
                          "--out", str(record), "--json", "--extra-body",
                          json.dumps({"structured_outputs": {"regex": CALLS}})],
                         env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode in (0, 1), ran.stderr
    kept = json.loads(ran.stdout)["id"]
    done = Episode.model_validate_json(record.read_text())
    assert done.task == "calc-add" and done.model == MODEL and len(done.turns) <= 3
    assert done.ended in ("steps", "submitted", "tool_calls") and done.tests_total == 2, done.reason
    assert done.workspace_sha256 is not None and done.tool_calls >= 1, "\n".join(
        str(t.refused) for t in done.turns)
    for turn in done.turns:
        assert turn.request_id is not None
        [audited] = until(lambda turn=turn: audit_records(running, turn.request_id), "the turn's audit record", 60)
        assert audited["username"] == "service-account-appliance-rl"
        if turn.refused is None:  # a refused answer's calls are recorded too, but never ran
            assert audited.get("tools_called") == ([step.name for step in turn.tools] or None), audited
    # Kept, listed and shown step by step; replayed from the store to the same workspace.
    listed = json.loads(running.appliance.run("rl", "episodes", "list", "--json").stdout)
    assert kept in [entry["id"] for entry in listed]
    shown = running.appliance.run("rl", "episodes", "show", kept)
    first = next(step for turn in done.turns for step in turn.tools)
    assert shown.returncode == 0 and f"{'ok' if first.ok else 'failed'} {first.name}" in shown.stdout
    replayed = running.appliance.run("rl", "episodes", "replay", kept, "--task", str(task), timeout=300)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "matches the episode's" in replayed.stdout
