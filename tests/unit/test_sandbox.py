"""The training sandbox: from inside it, the appliance's secrets, another job's data,
the supervisor's socket, the network and every place but the job's directory are out of reach,
and its memory and processes are capped; the job still trains (tests/unit/test_finetune.py and
tests/integration/test_finetune_worker.py train in it)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.settings import FinetuneSettings
from finetune.sandbox import SANDBOX_USER, prepare, sandbox_user, sandboxed

PROBE = r'''
import json, os, socket, sys, threading
home, port = sys.argv[1], int(sys.argv[2])
found = {}

def attempt(name, action):
    try:
        action()
        found[name] = "ok"
    except BaseException as exc:
        found[name] = type(exc).__name__

attempt("read_secret", lambda: open(f"{home}/secrets/engine-api-key").read())
attempt("read_other_job", lambda: open(f"{home}/jobs/2/train.jsonl").read())
attempt("supervisor_socket", lambda: socket.socket(socket.AF_UNIX).connect(f"{home}/run/supervisor.sock"))
attempt("host_tcp", lambda: socket.create_connection(("127.0.0.1", port), timeout=2))
attempt("write_model", lambda: open(f"{home}/model/config.json", "w"))
attempt("write_input", lambda: open("train.jsonl", "a"))
attempt("write_usr", lambda: open("/usr/evil", "w"))
attempt("read_input", lambda: open("train.jsonl").read())
attempt("read_model", lambda: open(f"{home}/model/config.json").read())
attempt("write_output", lambda: open("out.txt", "w").write("x"))
attempt("write_tmp", lambda: open("/tmp/scratch", "w").write("x"))
attempt("memory", lambda: bytearray(3 << 30))

def threads():
    started = [threading.Thread(target=threading.Event().wait, args=(5,), daemon=True) for _ in range(200)]
    for thread in started:
        thread.start()

attempt("processes", threads)
found["interfaces"] = [name for _, name in socket.if_nameindex()]
found["uid"] = os.getuid()
found["env"] = sorted(os.environ)
found["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
print(json.dumps(found))
'''


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    """A state dir as a job would find it on the host."""
    home = tmp_path / "home"
    (home / "secrets").mkdir(parents=True)
    (home / "secrets" / "engine-api-key").write_text("engine-secret")
    (home / "jobs" / "1").mkdir(parents=True)
    (home / "jobs" / "2").mkdir(parents=True)
    (home / "jobs" / "2" / "train.jsonl").write_text('{"text": "another team\'s data"}\n')
    (home / "jobs" / "1" / "train.jsonl").write_text('{"text": "ours"}\n')
    (home / "jobs" / "1" / "probe.py").write_text(PROBE)
    (home / "model").mkdir()
    (home / "model" / "config.json").write_text("{}")
    (home / "run").mkdir()
    return home


@pytest.mark.integration
def test_a_job_reaches_only_its_own_files(layout: Path) -> None:
    if os.geteuid() == 0:
        sandbox_user()  # bootstrap.sh creates it; the sandbox refuses to run without it
    workdir = layout / "jobs" / "1"
    inputs = [workdir / "train.jsonl"]
    supervisor = socket.socket(socket.AF_UNIX)
    supervisor.bind(str(layout / "run" / "supervisor.sock"))
    supervisor.listen()
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen()
    try:
        # As the appliance makes its own files (umask 077) and checkpoints are often saved.
        for private in (layout / "model", layout / "model" / "config.json", *inputs):
            private.chmod(0o700 if private.is_dir() else 0o600)
        prepare(workdir, inputs, [layout / "model"])
        command = sandboxed([sys.executable, "-I", str(workdir / "probe.py"), str(layout), str(host.getsockname()[1])],
                            FinetuneSettings(sandbox_memory_gib=1, sandbox_max_processes=64), workdir=workdir,
                            inputs=inputs, readable=[layout / "model"])
        ran = subprocess.run(command, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "APPLIANCE_HOME": str(layout)})
    finally:
        supervisor.close()
        host.close()
    assert ran.returncode == 0, ran.stderr
    found = json.loads(ran.stdout)
    for blocked in ("read_secret", "read_other_job", "supervisor_socket"):
        assert found[blocked] == "FileNotFoundError", (blocked, found)  # not there at all
    assert found["host_tcp"] == "ConnectionRefusedError" and found["interfaces"] == ["lo"], "no network"
    for blocked in ("write_model", "write_input", "write_usr"):
        assert found[blocked] in ("OSError", "PermissionError"), (blocked, found)  # read-only
    assert (found["read_input"], found["read_model"], found["write_output"], found["write_tmp"]) == ("ok",) * 4
    assert found["memory"] == "MemoryError" and found["processes"] == "RuntimeError"
    assert not [name for name in found["env"] if name.startswith("APPLIANCE_") or "KEY" in name]
    assert found["omp_wait_policy"] == "PASSIVE"  # it shares cores with the engines
    if os.geteuid() == 0:
        assert found["uid"] == sandbox_user().pw_uid, f"runs as {SANDBOX_USER}"
    assert (workdir / "out.txt").read_text() == "x"
    if os.geteuid() == 0:  # the input shown to the sandbox's group alone, still the appliance's
        shown = inputs[0].stat()
        assert (stat.S_IMODE(shown.st_mode), shown.st_uid, shown.st_gid) == (0o640, 0, sandbox_user().pw_gid)


def test_no_sandbox_when_told_and_a_clear_error_without_bubblewrap(layout: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    command = ["python", "-c", "1"]
    assert sandboxed(command, FinetuneSettings(sandbox="none"), workdir=layout, inputs=[], readable=[]) == command
    monkeypatch.setenv("PATH", str(layout))
    monkeypatch.setattr("finetune.sandbox.shutil.which", lambda name: None)
    from finetune.sandbox import SandboxError

    with pytest.raises(SandboxError, match="bubblewrap"):
        sandboxed(command, FinetuneSettings(), workdir=layout, inputs=[], readable=[])
