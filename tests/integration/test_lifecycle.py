"""up / status / chat / kill -9 / down against a real supervisord and a real vLLM; the
engine serves the demo model as staged for a one-host plan."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
from safetensors import safe_open

from appliance.secrets import secret
from appliance.supervisor import Supervisor, pid_alive
from installer.staging import verify_staged
from tests.integration.conftest import Running, Staged, engine_client
from tests.integration.realm import Realm
from tests.support.waiting import until

# It kills the session's engine and stops the whole session appliance.
pytestmark = pytest.mark.session_exclusive


def status(running: Running) -> dict:
    result = running.appliance.run("status", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def engine(running: Running) -> dict:
    [program] = [p for p in status(running)["programs"] if p["name"] == "vllm-main"]
    return program


def chat(running: Running, prompt: str) -> str:
    key = secret(running.appliance.home, "engine-api-key")
    with engine_client(running.appliance) as http:
        response = http.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 24,
                  "messages": [{"role": "user", "content": prompt}]},
        )
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def test_up_prints_what_runs_where(running: Running) -> None:
    out = running.up_output
    assert "vllm-main" in out and "RUNNING" in out
    # `up` fits 80 columns: the engine's socket is named, its whole path is in `status --wide`
    assert all(len(line) <= 80 for line in out.splitlines() if "RUNNING" in line)
    assert "socket" in out and "reach it at:" in out
    wide = running.appliance.run("status", "--wide")
    assert wide.returncode == 0, wide.stderr
    assert f"unix:{engine(running)['socket']}" in wide.stdout


def test_chat_completion_returns_text(running: Running) -> None:
    answer = chat(running, "What is the capital of France?")
    assert answer.strip()
    assert "Paris" in answer


def test_the_session_engine_serves_the_staged_copy(running: Running, staged_demo: Staged, demo_model: Path) -> None:
    assert verify_staged(staged_demo.directory)
    with safe_open(staged_demo.directory / "model.safetensors", "pt") as staged, \
            safe_open(demo_model / "model.safetensors", "pt") as original:
        assert sorted(staged.keys()) == sorted(original.keys())
        assert all(staged.get_tensor(n).equal(original.get_tensor(n)) for n in original.keys())
    log = (running.appliance.home.logs / "vllm-main.log").read_text()
    assert engine(running)["model"] == demo_model.name
    assert "Paris" in chat(running, "What is the capital of France?")
    assert str(staged_demo.directory) in log, "the engine was started on the staged directory"


def test_engine_refuses_requests_without_its_key(running: Running) -> None:
    with engine_client(running.appliance) as http:
        assert http.get("/v1/models").status_code == 401


def test_up_again_is_a_noop_that_says_so(running: Running) -> None:
    before = engine(running)["pid"]
    result = running.appliance.run("up")
    assert result.returncode == 0
    assert "already up" in result.stdout
    assert engine(running)["pid"] == before


def test_status_json_has_every_program_and_its_urls(running: Running) -> None:
    report = status(running)
    assert report["supervisord"]["running"] is True
    program = engine(running)
    assert program["pool"] == "main" and program["state"] == "RUNNING"
    assert program["pid"] > 0 and program["uptime_s"] >= 0 and program["healthy"] is True
    assert program["model"] == "SmolLM2-135M-Instruct"
    assert program["urls"]["openai"] == f"unix:{program['socket']}" and program["port"] is None
    human = running.appliance.run("status")
    assert "vllm-main" in human.stdout and "RUNNING" in human.stdout


def test_engine_killed_with_sigkill_is_restarted_and_serves(running: Running) -> None:
    """While the engine is down the gateway answers 503 at once, never hangs: supervisord is held
    (SIGSTOP) from the kill until the 503 is in, so the answer came while the engine could not be
    back (a gateway waiting for it would wait past the request's timeout)."""
    realm = Realm(running)
    token = realm.admin_token()
    through_gateway = {"url": f"{realm.gateway}/v1/chat/completions",
                       "headers": {"Authorization": f"Bearer {token}"}, "timeout": 60,
                       "json": {"model": "SmolLM2-135M-Instruct", "max_tokens": 4,
                                "messages": [{"role": "user", "content": "Hi"}]}}
    old = engine(running)["pid"]
    workers = [p.pid for p in psutil.Process(old).children(recursive=True)]
    assert workers, "vLLM runs its engine core in child processes"
    supervisord = Supervisor(running.appliance.home).daemon_pid()
    assert supervisord is not None
    os.kill(supervisord, signal.SIGSTOP)  # it cannot start the engine again until it runs on
    try:
        os.kill(old, signal.SIGKILL)
        until(lambda: not pid_alive(old), "the engine to die", 30)
        down = httpx.post(**through_gateway)
        assert not pid_alive(old) and psutil.Process(supervisord).status() == psutil.STATUS_STOPPED, \
            "answered while the engine was down and could not be started again"
    finally:
        os.kill(supervisord, signal.SIGCONT)
    assert down.status_code == 503 and down.headers["retry-after"]
    assert down.json()["error"]["code"] == "engine_unavailable"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        # Every request while the engine restarts must be answered, 503 until it is back, then
        # 200 (a hang times out here).
        answer = httpx.post(**{**through_gateway, "timeout": 30})
        assert answer.status_code in (200, 503), answer.text
        program = engine(running)
        if answer.status_code == 200 and program["pid"] not in (0, old) and program["healthy"]:
            break
        time.sleep(2)
    else:
        raise AssertionError(f"engine not back after kill -9: {program}")
    assert chat(running, "Say hello.").strip()
    assert httpx.post(**through_gateway).status_code == 200
    # The dead server's workers were re-parented; they must have been ended, not left running.
    assert not [pid for pid in workers if psutil.pid_exists(pid) and
                psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_engines_are_sealed_from_other_local_users(running: Running) -> None:
    """vLLM's own routes (/tokenize, /pause, /abort_requests ...) take no key, and a TCP
    port can be reached by any local user (or taken while the engine restarts). The engine's API
    is on a socket in a 0700 directory only, and its internal ports live in a network namespace
    of its own."""
    import subprocess
    import sys

    program = engine(running)
    tree = [psutil.Process(program["pid"]), *psutil.Process(program["pid"]).children(recursive=True)]
    vllm = [p for p in tree if "vllm" in " ".join(p.cmdline()) or p.name().startswith("VLLM")]
    assert vllm, f"no engine process among {[p.cmdline() for p in tree]}"
    assert all(os.readlink(f"/proc/{p.pid}/ns/net") != os.readlink("/proc/self/ns/net") for p in vllm), \
        "the engine runs in a network namespace of its own"
    # psutil matches a process's sockets against this namespace's /proc/net/tcp{,6}: from here,
    # which is any other local process's view, the engine listens on no TCP port at all.
    seen_here = [c for p in vllm for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert not seen_here, seen_here
    # vLLM's own listeners (ZMQ, torch.distributed) are on 127.0.0.1 of its namespace (its
    # /proc/<pid>/net/tcp, state 0A is LISTEN): nothing answers on those ports here.
    tables = [Path(f"/proc/{vllm[0].pid}/net/{table}").read_text() for table in ("tcp", "tcp6")]
    inside = {int(fields[1].rsplit(":", 1)[1], 16)
              for table in tables for line in table.splitlines()[1:] if (fields := line.split())[3] == "0A"}
    # Its namespace holds loopback alone: whatever listens inside (a one-rank CPU engine: nothing)
    # has no interface to be reached through or to reach out by.
    devices = Path(f"/proc/{vllm[0].pid}/net/dev").read_text().splitlines()[2:]
    assert [line.split(":")[0].strip() for line in devices] == ["lo"], devices
    import socket
    for port in inside:
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
            probe.connect(("127.0.0.1", port))
    socket_dir = Path(program["socket"]).parent
    assert socket_dir.stat().st_mode & 0o777 == 0o700
    with engine_client(running.appliance) as http:
        assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 200, "the route exists, unauthenticated"
    probe = ("import socket, sys; s = socket.socket(socket.AF_UNIX)\n"
             "try:\n    s.connect(sys.argv[1]); print('CONNECTED')\nexcept OSError as e:\n    print(type(e).__name__)")
    as_nobody = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-I",
                                "-c", probe, program["socket"]], capture_output=True, text=True, timeout=60)
    assert as_nobody.stdout.strip() == "PermissionError", as_nobody.stdout + as_nobody.stderr


def test_down_leaves_no_process_behind(running: Running) -> None:
    supervisord = status(running)["supervisord"]["pid"]
    tree = [supervisord] + [p.pid for p in psutil.Process(supervisord).children(recursive=True)]
    assert len(tree) >= 3
    result = running.appliance.run("down")
    assert result.returncode == 0 and "down" in result.stdout
    alive = [pid for pid in tree if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive
    again = running.appliance.run("down")
    assert again.returncode == 0 and "not running" in again.stdout
    assert status(running)["supervisord"]["running"] is False

