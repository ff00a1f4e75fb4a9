"""The whole appliance, for real: supervisord running Keycloak, vLLM serving the demo model (as
staged for a one-host plan) and the gateway, started once per session and shared by the
integration tests."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from minio import Minio

from appliance.engine_launch import engine_socket
from installer.hardware import parse_hardware_spec
from installer.model_config import load_model_config
from installer.planner import plan
from installer.staging import stage_subset
from tests.support.appliances import Appliance
from tests.support.nvml import build_fake_nvml
from tests.support.ports import free_port
from tests.support.session import Running, running_again, start_or_join
from tests.support.shared import WAITS, locked, shared_dir

RCLONE = str(Path(sys.executable).with_name("rclone"))
ACCESS_KEY, SECRET_KEY = "appliance-test", "s3-secret-for-tests-only-0123456789"

# Session settings the gateway tests rely on: small per-user budgets and caps for role `user`
# (the rate-limit test, test_attacks' limits), little clock leeway (the expiry test), quick
# re-introspection (the disabled-user test), and small audit files archived often (the archive
# test).
SESSION_SETTINGS = {
    "APPLIANCE_GATEWAY__LIMITS": "{ user = { requests_per_minute = 60, tokens_per_minute = 4000, max_concurrent = 8, "
                                 "max_n = 2, max_logprobs = 2 }, admin = { requests_per_minute = 100000, "
                                 "tokens_per_minute = 10000000, max_concurrent = 1000 } }",
    "APPLIANCE_GATEWAY__LEEWAY_S": "1",
    "APPLIANCE_GATEWAY__HEADER_TIMEOUT_S": "3",  # test_attacks: half-open connections
    "APPLIANCE_GATEWAY__BODY_TIMEOUT_S": "3",  # test_attacks: stalled bodies
    "APPLIANCE_GATEWAY__MAX_CONNECTIONS": "1024",
    "APPLIANCE_GATEWAY__INTROSPECT_TTL_S": "1",
    "APPLIANCE_AUDIT__MAX_FILE_BYTES": "65536",
    "APPLIANCE_AUDIT__ARCHIVE_INTERVAL_S": "2",
    # test_compliance_filter: a role whose cards in prompts are redacted (the engine sees it) and let out in answers.
    "APPLIANCE_COMPLIANCE__ROLES": '{ admin = { prompts = { payment_card = "redact" }, '
                                   'answers = { payment_card = "allow" } } }',
    # test_attacks: a named tool_choice (structured output) makes real tool calls; vLLM 0.32 needs both.
    "APPLIANCE_POOLS__MAIN__EXTRA_ARGS": '["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]',
    # test_keycloak_logins: 3 wrong passwords in a row lock an account for 10 s (long enough to see on a
    # loaded machine, where Keycloak on PostgreSQL records a failure a moment late), by their count alone (no
    # quick-login check: another test's wrong password or two locks no one); Keycloak's events
    # copied every second.
    "APPLIANCE_KEYCLOAK__LOCKOUT_FAILURES": "3",
    "APPLIANCE_KEYCLOAK__LOCKOUT_WAIT_S": "10",
    "APPLIANCE_KEYCLOAK__LOCKOUT_MAX_WAIT_S": "20",
    "APPLIANCE_KEYCLOAK__QUICK_LOGIN_CHECK_MS": "0",
    "APPLIANCE_KEYCLOAK__EVENTS_POLL_S": "1",
    # test_monitoring: rules evaluated every 2 s.
    "APPLIANCE_MONITORING__SCRAPE_INTERVAL_S": "2",
    # test_watchdog: an engine wedged for 20 s is restarted (long enough that a loaded machine's slow
    # answer is not taken for a wedge).
    "APPLIANCE_WATCHDOG__ENGINE_STALL_S": "20",
    "APPLIANCE_WATCHDOG__CHECK_INTERVAL_S": "1",
    "APPLIANCE_WATCHDOG__BACKOFF_S": "5",
    # test_finetune_worker: a job whose trainer makes no progress for 90 s has its worker ended (the trainer beats
    # at each step and evaluation batch; its start on a loaded machine takes well under that).
    "APPLIANCE_WATCHDOG__TRAINING_STALL_S": "90",
    # The shared appliance's adapters are trained to answer narrowly (test_canary teaches a wrong answer), and
    # gated on one greedy answer per item so their verdicts do not depend on sampling; the seeds and the shipped
    # regression set are shown on the trainer itself (tests/unit/test_finetune.py).
    "APPLIANCE_FINETUNE__GATE_SEEDS": "1",
    "APPLIANCE_FINETUNE__REGRESSION_SET": "none",
}


@dataclass
class Staged:
    directory: Path
    plan_file: Path


@pytest.fixture(scope="session")
def staged_demo(demo_model: Path) -> Staged:
    """The demo model staged (`subset`) for a one-host plan, once per run: the session's engine
    serves this copy with that plan, so every integration test also shows that staged weights load
    and answer in vLLM."""
    out = shared_dir() / "staged"
    plan_file = out / "plan.json"
    with locked("staged", exclusive=True):
        if not plan_file.exists():
            record = plan(load_model_config(demo_model), parse_hardware_spec("1x1xL4-24GB"), context=2048,
                          concurrency=1, model_ref=str(demo_model))
            [staged] = stage_subset(demo_model, record, out)
            (out / "directory").write_text(str(staged.directory))
            plan_file.write_text(record.model_dump_json(indent=1))  # last: the copy is whole
    return Staged(Path((out / "directory").read_text()), plan_file)


@pytest.fixture(scope="session")
def running(demo_model: Path, keycloak_dist: Path, staged_demo: Staged) -> Running:
    """The appliance the integration tests share (tests.support.session): one per run, whichever
    worker asks first starts it."""
    with locked("fake-nvml", exclusive=True):  # test_monitoring: GPU figures through Prometheus
        nvml = shared_dir() / "libnvidia-ml.so.1"
        if not nvml.exists():
            build_fake_nvml(shared_dir()).chmod(0o755)
    served = {"APPLIANCE_POOLS__MAIN__MODEL": str(staged_demo.directory),
              "APPLIANCE_MONITORING__NVML_LIBRARY": str(nvml),
              "APPLIANCE_POOLS__MAIN__PLAN": str(staged_demo.plan_file),
              "APPLIANCE_POOLS__MAIN__SERVED_MODEL_NAME": demo_model.name,
              # test_monitoring listens there (the port is in the session's record, for every worker).
              "APPLIANCE_MONITORING__WEBHOOK_URL": f"http://127.0.0.1:{free_port()}/alerts"}
    return start_or_join(demo_model, keycloak_dist, SESSION_SETTINGS | served)


@pytest.fixture(scope="module", autouse=True)
def module_locks(request: pytest.FixtureRequest) -> Iterator[None]:
    """What a module may share while it runs, held for the whole module (each worker runs one
    module at a time, taking these in this order, so two workers never wait on each other in a
    circle):
    - the machine: a module marked `alone` (it starts several engines of its own) runs while no
      other integration module does, so that the appliances running at once fit in memory;
    - the session appliance: a module marked `session_exclusive` (it stops, kills or restarts its
      parts, or counts what reaches its engine or audit log) has it to itself; the others share it.
    An exclusive module leaves the session appliance running, and every module finds it so:
    modules run in no fixed order, so none assumes what one before it left."""
    module = request.node
    uses_session = any("running" in item.fixturenames for item in request.session.items if item.path == module.path)
    exclusive = module.get_closest_marker("session_exclusive") is not None
    with ExitStack() as held:
        asked = time.monotonic()
        held.enter_context(locked("machine", exclusive=module.get_closest_marker("alone") is not None))
        if uses_session:
            held.enter_context(locked("session", exclusive=exclusive))
        record_wait(module.path, time.monotonic() - asked)
        if uses_session:
            running_again(request.getfixturevalue("running"))
        yield
        if uses_session and exclusive:
            running_again(request.getfixturevalue("running"))


def record_wait(module: Path, seconds: float) -> None:
    """How long a module waited for its locks, for the run's report of module times."""
    name = module.relative_to(Path(__file__).parents[2]).as_posix()
    with (shared_dir() / WAITS).open("a") as waits:
        waits.write(json.dumps({"module": name, "waited_s": round(seconds, 1)}) + "\n")


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[str]:
    """host:port of an S3 server on loopback, storing into a temporary directory."""
    yield from s3_server(tmp_path)


def s3_server(tmp_path: Path) -> Iterator[str]:
    """An S3 server (rclone) on loopback storing into `tmp_path`, for as long as the generator lives."""
    port = free_port()
    server = subprocess.Popen([RCLONE, "serve", "s3", "--config", str(tmp_path / "rclone.conf"),
                               "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}", "--addr", f"127.0.0.1:{port}",
                               str(tmp_path / "buckets")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(30)


def client(s3: str) -> Minio:
    return Minio(s3, access_key=ACCESS_KEY, secret_key=SECRET_KEY, secure=False, region="us-east-1")


def s3_settings(s3: str) -> dict[str, str]:
    """Environment settings pointing the artifact store at the test's S3 server."""
    return {"APPLIANCE_ARTIFACTS__STORE": "s3", "APPLIANCE_ARTIFACTS__S3_ENDPOINT": s3,
            "APPLIANCE_ARTIFACTS__S3_SECURE": "false", "APPLIANCE_ARTIFACTS__S3_ACCESS_KEY": ACCESS_KEY,
            "APPLIANCE_ARTIFACTS__S3_SECRET_KEY": SECRET_KEY}


def engine_client(appliance: Appliance, pool: str = "main", timeout: float = 120) -> httpx.Client:
    """An HTTP client to a pool's engine, over its Unix socket (engines listen on no TCP port)."""
    socket = engine_socket(appliance.home, pool)
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://engine", timeout=timeout)
