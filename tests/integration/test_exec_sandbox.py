"""The execution sandbox against hostile programs, for real (bubblewrap, prlimit, the
dedicated user): each is contained, and scored as a failure with its reason; the host and the
other processes are untouched."""

from __future__ import annotations

import os
import pwd
import subprocess
import time
from pathlib import Path

import pytest

from appliance.home import Home
from appliance.settings import ExecutionSettings
from finetune.rl.execute import EXEC_UIDS, EXEC_USER, Sandbox, execute
from tests.support.appliances import APPLIANCE

# It asserts that no execution's process is left on the host.
pytestmark = pytest.mark.usefixtures("sandbox_users_to_itself")

SETTINGS = ExecutionSettings(cpu_s=3, wall_s=15, test_wall_s=6, memory_mib=256, processes=32, tmpfs_mib=16,
                             output_bytes=65536)
SAFE = "def test_ok():\n    pass\n"  # the hostile code runs when the answer's process loads it
DID_NOT_LOAD = "test_ok: the program did not load: "  # it raised (or left) while it loaded
ENDED = "test_ok: the program ended before it answered"  # its process ended (a signal, a limit)


def run(program: str, tests: str = SAFE) -> tuple[str, str, str]:
    verdict = execute(program, "python", SETTINGS, tests=tests)
    assert verdict.status == "failed", verdict
    return verdict.reason, verdict.stderr, verdict.stdout


def exec_user_processes_after(seconds: float = 5.0) -> list[str]:
    """Those processes still there after `seconds` at most (a namespace's processes are reaped by
    the kernel as its process 1 exits, a moment after the verdict is in)."""
    deadline = time.monotonic() + seconds
    while (left := exec_user_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def exec_user_processes() -> list[str]:
    """Processes running as an execution's user (ids drawn from EXEC_UIDS) or as appliance-exec."""
    listed = subprocess.run(["ps", "-eo", "uid=,pid=,args="], capture_output=True, text=True).stdout.splitlines()
    own = {pwd.getpwnam(EXEC_USER).pw_uid} if EXEC_USER in {p.pw_name for p in pwd.getpwall()} else set()
    return [line for line in listed
            if int(line.split()[0]) in own or EXEC_UIDS[0] <= int(line.split()[0]) < EXEC_UIDS[1]]


def test_a_correct_program_passes_and_a_wrong_one_fails_with_the_failing_test() -> None:
    program = "def add(a, b):\n    return a + b\n"
    passed = execute(program, "python", SETTINGS, tests="def test_add():\n    assert add(2, 3) == 5\n")
    assert (passed.status, passed.tests_passed, passed.tests_total) == ("passed", 1, 1)
    failed = execute(program, "python", SETTINGS, tests="def test_a():\n    assert add(1, 1) == 2\n\n"
                                                          "def test_b():\n    assert add(1, 1) == 3\n")
    assert (failed.status, failed.reason, failed.tests_passed, failed.tests_total) == (
        "failed", "test_b: AssertionError", 1, 2)
    assert "AssertionError" in failed.stderr
    human_eval = execute(program, "python", SETTINGS, entry_point="add",
                         tests="def check(candidate):\n    assert candidate(2, 2) == 4\n")
    assert human_eval.status == "passed" and human_eval.tests[0].test == "check"


def test_c_compiles_and_runs_against_io_cases() -> None:
    program = '#include <stdio.h>\nint main(void){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);return 0;}\n'
    cases = [{"stdin": "1 2", "stdout": "3"}, {"stdin": "5 5", "stdout": "9"}]
    verdict = execute(program, "c", SETTINGS, io_cases=cases)
    assert (verdict.tests_passed, verdict.tests_total, verdict.reason) == (1, 2, "io: wrong output")
    broken = execute("int main(void) { return x; }\n", "c", SETTINGS, io_cases=[{"stdin": "", "stdout": ""}])
    assert broken.reason == "compile error" and "undeclared" in broken.stderr


def test_no_network() -> None:
    reason, stderr, _ = run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)\n")
    assert reason.startswith(DID_NOT_LOAD) and ("Network is unreachable" in stderr or "OSError" in stderr)
    gateway = run("import socket\nsocket.create_connection(('127.0.0.1', 8080), timeout=3)\n")[1]
    assert "Connection refused" in gateway, "the host's loopback is not the sandbox's"


def test_no_secrets_and_no_other_jobs_data(tmp_path: Path) -> None:
    secrets = Home.from_env().secrets
    other_job = tmp_path / "job-1" / "train.jsonl"
    other_job.parent.mkdir()
    other_job.write_text("private\n")
    for path in (secrets / "engine-api-key", secrets, other_job, Home.from_env().root / "hosts.json"):
        reason, stderr, _ = run(f"print(open({str(path)!r}).read())\n")
        assert reason.startswith(DID_NOT_LOAD) and ("FileNotFoundError" in stderr or "IsADirectoryError" in stderr), \
            path


def test_nothing_writable_but_its_tmpfs() -> None:
    for target in ("/usr/evil", "/task/program.py", "/etc/evil", "/evil"):
        reason, stderr, _ = run(f"open({target!r}, 'w').write('x')\n")
        assert reason.startswith(DID_NOT_LOAD) and ("Read-only file system" in stderr or "Permission denied" in stderr
                                                 or "No such file" in stderr), target
    reason, stderr, _ = run("with open('/tmp/big', 'wb') as f:\n    for _ in range(64):\n"
                            "        f.write(b'x' * 2**20)\n")
    assert reason.startswith(DID_NOT_LOAD) or "file size limit" in reason, (reason, stderr)


def test_a_fork_bomb_is_contained() -> None:
    started = time.monotonic()
    reason, stderr, _ = run("import os\nwhile True:\n    os.fork()\n")
    assert reason.startswith("test_ok:") and time.monotonic() - started < SETTINGS.wall_s + 5
    assert not exec_user_processes(), "nothing of the sandbox outlives it"


def test_a_memory_bomb_is_contained() -> None:
    reason, stderr, _ = run("x = bytearray(8 * 2**30)\n")
    assert reason.startswith(DID_NOT_LOAD) and "MemoryError" in stderr


def test_an_infinite_loop_hits_the_cpu_limit() -> None:
    reason, _, _ = run("while True:\n    pass\n")
    assert reason == f"{ENDED} (signal SIGXCPU: CPU time limit)"
    sleeper = run("import time\ntime.sleep(3600)\n")[0]
    assert sleeper == f"test_ok: test wall time over {SETTINGS.test_wall_s:g} s"


def test_ten_gigabytes_of_output_end_it() -> None:
    started = time.monotonic()
    reason, _, stdout = run("import sys\nfor _ in range(10 * 1024):\n    sys.stdout.write('x' * 2**20)\n")
    assert reason == f"stdout over {SETTINGS.output_bytes:,} bytes" and len(stdout) < 2 * SETTINGS.kept_bytes + 200
    assert time.monotonic() - started < SETTINGS.wall_s


def test_a_child_that_outlives_its_parent_is_ended() -> None:
    program = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\n"
               "sys.exit(3)\n")
    reason, _, _ = run(program)
    assert reason == f"{DID_NOT_LOAD}SystemExit: 3"
    assert not exec_user_processes_after(), "the orphan died with the sandbox"


def test_signals_reach_no_one_outside(tmp_path: Path) -> None:
    victim = subprocess.Popen(["sleep", "60"])
    try:
        program = (f"import os, signal\nfor pid in (1, {os.getpid()}, {victim.pid}):\n"
                   "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as exc:\n"
                   "        print(pid, type(exc).__name__)\nraise SystemExit(2)\n")
        reason, _, stdout = run(program)
        assert reason == f"{DID_NOT_LOAD}SystemExit: 2"
        assert victim.poll() is None, "a process outside was killed"
        assert f"{victim.pid} ProcessLookupError" in stdout or f"{victim.pid} PermissionError" in stdout
    finally:
        victim.kill()
        victim.wait()


def test_a_forged_score_is_not_counted() -> None:
    """The score travels on a descriptor the untrusted code never holds."""
    program = ("import os\nfor fd in range(3, 64):\n    try:\n"
               "        os.write(fd, b'{\"compiled\": true, \"results\": [{\"test\": \"x\", \"passed\": true, '\n"
               "                 b'\"reason\": \"passed\", \"seconds\": 0}]}')\n    except OSError:\n        pass\n"
               "raise SystemExit(1)\n")
    verdict = execute(program, "python", SETTINGS, tests=SAFE)
    assert (verdict.status, verdict.tests_passed) == ("failed", 0)


@pytest.mark.parametrize("leave", ["import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n"])
def test_leaving_before_the_tests_ran_does_not_pass(leave: str) -> None:
    verdict = execute(leave, "python", SETTINGS, tests="def test_add():\n    assert add(2, 3) == 5\n")
    assert verdict.status == "failed" and verdict.tests_passed == 0
    assert verdict.reason in ("test_add: the program ended before it answered (exit 0)",
                              "test_add: the program did not load: SystemExit: 0")


def test_the_cli_prints_a_verdict(tmp_path: Path) -> None:
    program = tmp_path / "add.py"
    program.write_text("def add(a, b):\n    return a - b\n")
    tests = tmp_path / "tests.py"
    tests.write_text("def test_add():\n    assert add(2, 3) == 5\n")
    shown = subprocess.run([APPLIANCE, "rl", "exec", str(program), "--tests", str(tests), "--json"],
                           capture_output=True, text=True)
    assert shown.returncode == 1 and '"reason": "test_add: AssertionError"' in shown.stdout
    bad = tmp_path / "cases.json"
    bad.write_text('[{"stdin": "1"}, 3]')
    refused = subprocess.run([APPLIANCE, "rl", "exec", str(program), "--tests", str(bad)], capture_output=True,
                             text=True)
    assert refused.returncode != 0 and f"--tests {bad}: [1]" in refused.stderr


@pytest.mark.parametrize("language", ["ruby"])
def test_an_unknown_language_is_refused(language: str, tmp_path: Path) -> None:
    program = tmp_path / "p.rb"
    program.write_text("puts 1\n")
    refused = subprocess.run([APPLIANCE, "rl", "exec", str(program), "--language", language], capture_output=True,
                             text=True)
    assert refused.returncode != 0 and "--language 'ruby': python or c" in refused.stderr


# Regressions from the attacker review of the sandbox (each was possible before).


def test_io_cases_cannot_be_read_for_their_answers() -> None:
    """The expected outputs never enter the sandbox: a program that looks them up finds none."""
    program = ("import json, sys\ncases = json.load(open('/task/tests.json'))\nline = sys.stdin.read()\n"
               "print(next((c.get('stdout', '') for c in cases if c['stdin'] == line), ''))\n")
    verdict = execute(program, "python", SETTINGS, io_cases=[{"stdin": "2 3", "stdout": "5"}])
    assert (verdict.tests_passed, verdict.reason) == (0, "io: wrong output")


def test_the_harness_and_the_answers_template_cannot_be_traced_or_read() -> None:
    program = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "for pid in (1, os.getppid()):\n"  # the harness (process 1), the template (the answer's parent)
               "    attached = libc.ptrace(16, pid, 0, 0)\n    print('attach', attached, ctypes.get_errno())\n"
               "    try:\n        open(f'/proc/{pid}/mem', 'rb').read(1)\n        print('memory read')\n"
               "    except OSError as exc:\n        print('memory', type(exc).__name__)\nraise SystemExit(4)\n")
    reason, _, stdout = run(program)
    assert reason == f"{DID_NOT_LOAD}SystemExit: 4" and stdout.count("attach -1") == 2 and "memory read" not in stdout


def test_no_answer_ever_holds_the_tests_in_its_memory() -> None:
    # Each answer is a fork of the answers' template, forked before the tests were read: a scan of
    # the answer's whole memory finds a control string it made, and nothing of the tests.
    program = ("import ctypes, os, re\ncontrol = 'CONTROL_' + str(10**11 * 4 + 12345) + '_END'\n"
               # dumpable again, so that its own /proc/self/mem is readable
               "def scan():\n    found = set()\n    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)\n"
               "    fd = os.open('/proc/self/mem', os.O_RDONLY)\n"
               "    for line in open('/proc/self/maps'):\n        span, perms = line.split()[:2]\n"
               "        if 'r' not in perms:\n            continue\n"
               "        start, end = (int(x, 16) for x in span.split('-'))\n"
               "        try:\n            chunk = os.pread(fd, end - start, start)\n        except OSError:\n"
               "            continue\n"
               "        found |= {m.decode() for m in re.findall(rb'(?:CONTROL|SEKRIT)_[0-9]{12}_END', chunk)}\n"
               "    return sorted(found)\n")
    tests = ("def test_scan():\n    assert scan() == ['SEKRIT_482915730264_END']\n\n"
             "def test_control():\n    assert 'CONTROL_400000012345_END' in scan()\n")
    verdict = execute(program, "python", SETTINGS, tests=tests)
    assert [(t.test, t.passed) for t in verdict.tests] == [("test_scan", False), ("test_control", True)], verdict
    assert "SEKRIT" not in verdict.tests[0].reason.split("==")[0], verdict.tests[0].reason


ADD = "def add(a, b):\n    return a + b\n"
SIX_TESTS = "".join(f"def test_{i}():\n    assert add({i}, 1) == {i + 1}\n\n" for i in range(6))
# On its first load only (the file marks it), the answer stops or kills its parent, the template;
# `resume` also has a process of its own wake the template later, so that its late replies could
# answer the harness's next questions.
TEMPLATE_ATTACKS = {
    "kill": "os.kill(os.getppid(), signal.SIGKILL)",
    "stop": "os.kill(os.getppid(), signal.SIGSTOP)",
    "stop-then-resume": ("parent = os.getppid()\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(5.3)\n"
                         "    os.kill(parent, signal.SIGCONT)\n    os._exit(0)\nos.kill(parent, signal.SIGSTOP)"),
}


@pytest.mark.parametrize("attack", sorted(TEMPLATE_ATTACKS))
def test_an_answer_that_ends_or_stops_its_template_fails_only_itself_and_at_once(attack: str) -> None:
    program = ("import os, signal, time\nif not os.path.exists('/tmp/done'):\n    open('/tmp/done', 'w').close()\n"
               + "".join(f"    {line}\n" for line in TEMPLATE_ATTACKS[attack].split("\n")) + ADD)
    with Sandbox(SETTINGS) as sandbox:
        verdict = sandbox.run(program, "python", tests=SIX_TESTS)
        honest = sandbox.run(ADD, "python", tests=SIX_TESTS)
    # The first test's answer did its work; the template is ended at the first exchange it fails
    # (one wait of at most 5 s), and every later test fails at once: never a late reply believed,
    # never the execution's wall time.
    assert verdict.status == "failed" and verdict.tests_passed <= 1 and verdict.wall_s < SETTINGS.wall_s, verdict
    assert all("the answers' template is gone" in t.reason for t in verdict.tests[1:]), verdict.tests
    assert honest.status == "passed", honest


def test_no_request_of_an_earlier_execution_is_in_a_later_one_s_memory() -> None:
    # The zygote's requests (entry point, user) are parsed only in each execution's own processes
    # and wiped from the zygote after: an answer forked from it later finds none of them.
    scan = ("import ctypes, os, re\n"
            "def found():\n    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)\n    seen = set()\n"
            "    fd = os.open('/proc/self/mem', os.O_RDONLY)\n"
            "    for line in open('/proc/self/maps'):\n        span, perms = line.split()[:2]\n"
            "        if 'r' not in perms:\n            continue\n"
            "        start, end = (int(x, 16) for x in span.split('-'))\n"
            "        try:\n            chunk = os.pread(fd, end - start, start)\n        except OSError:\n"
            "            continue\n        seen |= {m.decode() for m in re.findall(rb'ZZ[A-Z]{4,}QQ', chunk)}\n"
            "    print('found', sorted(seen))\n")
    with Sandbox(SETTINGS) as sandbox:
        first = sandbox.run("def zzfunc(x):\n    return x\n", "python", entry_point="ZZENTRYQQ",
                            tests="def check(candidate):\n    assert candidate(1) == 1\n")
        second = sandbox.run(scan, "python", tests="def test_scan():\n    found()\n")
    assert first.status == "failed", first  # (zzfunc is not the entry point)
    assert second.status == "passed" and "found []" in second.stdout, second


def test_a_file_the_program_leaves_where_tracebacks_look_cannot_hang_the_harness() -> None:
    program = "import os\nif not os.path.exists('/tmp/tests.py'):\n    os.mkfifo('/tmp/tests.py')\n" + ADD
    verdict = execute(program, "python", SETTINGS, tests="def test_wrong():\n    assert add(1, 1) == 3\n")
    assert verdict.status == "failed" and verdict.reason == "test_wrong: AssertionError", verdict


def test_one_execution_cannot_starve_another_or_leave_it_state() -> None:
    hog = ("import os, time\nfor _ in range(100):\n    try:\n        if os.fork() == 0:\n            time.sleep(30)\n"
           "    except OSError:\n        break\ntime.sleep(30)\n")
    keep = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
            "libc.syscall(248, b'user', b'left-behind', b'secret', 6, -4)\n")  # add_key to the user keyring
    find = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
            "found = libc.syscall(250, 10, -4, b'user', b'left-behind', 0)\n"  # keyctl(KEYCTL_SEARCH, ...)
            "raise SystemExit(5 if found > 0 else 6)\n")
    from concurrent.futures import ThreadPoolExecutor
    honest = "def add(a, b):\n    return a + b\n"
    with ThreadPoolExecutor(2) as pool:
        hogging = pool.submit(execute, hog, "python", SETTINGS, tests=SAFE)
        time.sleep(1.0)
        verdict = execute(honest, "python", SETTINGS, tests="def test_add():\n    assert add(1, 2) == 3\n")
        hogging.result()
    assert verdict.status == "passed", verdict
    execute(keep, "python", SETTINGS, tests=SAFE)
    assert run(find)[0] == f"{DID_NOT_LOAD}SystemExit: 6", "a key left by one execution is not found by the next"


def test_the_harness_cannot_be_ended_from_inside_a_broken_one_scores_a_failure_and_no_terminal_exists() -> None:
    # The harness is process 1 of the execution's PID namespace: no signal from inside reaches it.
    program = ("import os, signal\nfor sent in (signal.SIGKILL, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
               "    os.kill(os.getppid(), sent)\n")
    # The tests run in the harness, process 1: it lived through the signals to run them.
    survived = execute(program, "python", SETTINGS, tests="import os\n\ndef test_ok():\n    assert os.getpid() == 1\n")
    assert survived.status == "passed", survived
    # Tests it cannot read end it before it reports: a failure, never a pass.
    verdict = execute("def f():\n    pass\n", "python", SETTINGS, tests="def test_ok(:\n    pass\n")
    assert verdict.status == "failed" and verdict.reason.startswith("the sandbox ended without a report"), verdict
    reason, stderr, _ = run("open('/dev/ptmx', 'rb')\n")
    assert reason.startswith(DID_NOT_LOAD) and "No such file" in stderr


def test_its_processes_are_capped_together_where_the_host_allows() -> None:
    groups = Path("/sys/fs/cgroup/pids/appliance-exec")
    before = set(groups.glob("*/"))
    verdict = execute("def f():\n    pass\n", "python", SETTINGS, tests=SAFE)
    assert verdict.status == "passed"
    if os.geteuid() == 0 and Path("/sys/fs/cgroup/pids/cgroup.procs").exists():
        assert verdict.cgroup
        deadline = time.monotonic() + 10  # removed in the background once the kernel let its processes go
        while set(groups.glob("*/")) - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not set(groups.glob("*/")) - before, "its cgroup is removed after it"


# Executions forked by one cell's zygote (finetune.rl.zygote), as a sandbox worker runs them.


def test_each_execution_has_no_privilege_and_sees_only_itself() -> None:
    probe = ("import os\nstatus = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
             "caps = [status[k].strip() for k in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb')]\n"
             "print(os.getuid(), status['NoNewPrivs'].strip(), set(caps), os.listdir('/cells'))\n"
             "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n")
    verdict = execute(probe, "python", SETTINGS, tests=SAFE)
    assert verdict.status == "passed", verdict
    who, processes = verdict.stdout.splitlines()
    uid, no_new_privileges, caps, cells = who.split(" ", 3)
    assert no_new_privileges == "1" and caps == "{'0000000000000000'}"
    assert cells == "[]", "the cell's task directories (this one's included) are not the execution's"
    # The answers' template became the only test's answer: its harness and itself, not the zygote, not another.
    assert processes == "[1, 2]", "only its harness and itself: not the zygote, not another execution"
    if os.geteuid() == 0:
        assert EXEC_UIDS[0] <= int(uid) < EXEC_UIDS[1]


def test_a_cell_leaves_nothing_of_one_execution_to_the_next() -> None:
    leave = ("import os, subprocess, sys\nopen('/tmp/left', 'w').write('x')\n"
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
             "print(os.getuid())\n")
    look = ("import os\nprint(os.getuid(), os.path.exists('/tmp/left'), "
            "sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n")
    with Sandbox(SETTINGS) as sandbox:
        first = sandbox.run(leave, "python", tests=SAFE)
        second = sandbox.run(look, "python", tests=SAFE)
    assert first.status == second.status == "passed", (first, second)
    uid, left, processes = second.stdout.strip().split(" ", 2)
    assert (left, processes) == ("False", "[1, 2]"), second.stdout
    if os.geteuid() == 0:
        assert uid != first.stdout.strip(), "each execution has a user of its own"
    assert not exec_user_processes(), "what the first left running ended with it"


def test_a_cell_killed_for_a_limit_is_replaced() -> None:
    with Sandbox(SETTINGS.model_copy(update={"wall_s": 2.0})) as sandbox:
        stuck = sandbox.run("import signal, time\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\ntime.sleep(60)\n",
                            "python", tests=SAFE)
        after = sandbox.run("def add(a, b):\n    return a + b\n", "python",
                            tests="def test_add():\n    assert add(1, 2) == 3\n")
    assert stuck.reason == "wall time over 2 s" and after.status == "passed", (stuck, after)
    assert not exec_user_processes()


def test_no_user_namespace_and_threads_still_work() -> None:
    """In a user namespace of its own a program would hold capabilities again (and could mount a
    tmpfs past its size limit): a system call filter refuses them; threads and processes still start."""
    program = ("import ctypes, subprocess, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
               "tool = subprocess.run(['unshare', '-Urm', 'true'], capture_output=True, text=True)\n"
               "print('tool', tool.returncode, 'Operation not permitted' in tool.stderr)\n"
               "seen = []\nthread = threading.Thread(target=seen.append, args=(1,))\nthread.start()\nthread.join()\n"
               "print('thread', seen)\n")
    verdict = execute(program, "python", SETTINGS, tests=SAFE)
    assert verdict.status == "passed", verdict
    assert verdict.stdout.splitlines() == ["unshare -1 1", "tool 1 True", "thread [1]"], verdict.stdout


def test_a_cell_that_ends_under_an_execution_is_an_error_not_a_failure() -> None:
    import threading

    from finetune.sandbox import SandboxError

    with Sandbox(SETTINGS) as sandbox:
        outcome: list[object] = []
        sleeper = "import time\ntime.sleep(30)\n"
        running = threading.Thread(target=lambda: outcome.append(_run_or_error(sandbox, sleeper)))
        running.start()
        time.sleep(1.5)
        assert sandbox._cell is not None  # the test's view of the cell: killed as the host might lose it
        os.killpg(sandbox._cell.pid, 9)
        running.join(timeout=20)
        assert outcome and isinstance(outcome[0], SandboxError), outcome
        after = sandbox.run("def f():\n    pass\n", "python", tests=SAFE)
    assert after.status == "passed", "the next execution gets a new cell"


def _run_or_error(sandbox: Sandbox, program: str) -> object:
    try:
        return sandbox.run(program, "python", tests=SAFE)
    except Exception as exc:
        return exc


def test_many_cases_with_long_right_answers_pass() -> None:
    """The report carries each case's output (up to 64 KiB): it is not the program's output."""
    program = "import sys\nn = int(sys.stdin.read())\nprint('x' * n)\n"
    cases = [{"stdin": str(60_000 + i), "stdout": "x" * (60_000 + i)} for i in range(20)]
    verdict = execute(program, "python", SETTINGS, io_cases=cases)
    assert (verdict.status, verdict.tests_passed) == ("passed", 20), verdict.reason
