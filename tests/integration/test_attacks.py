"""The gateway tried as an attacker would, against the real appliance (real gateway,
Keycloak, vLLM and supervisord, shared with the other integration tests). Each test makes one
attack and asserts what it now gets."""

from __future__ import annotations

import base64
import json
import resource
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from appliance.home import Home
from appliance.secrets import gateway_client_secret
from appliance.supervisor import Supervisor
from appliance.tls import ensure_server_certificate
from audit.writer import log_files
from tests.integration.conftest import Running
from tests.integration.realm import Realm
from tests.support.impostor import Impostor
from tests.support.scrape import gateway_metrics
from tests.support.waiting import until

REFUSAL_INTERVAL_S = 10  # audit.refusal_interval_s's default, which the session appliance keeps

# It restarts the session's Keycloak and measures how its audit log grows.
pytestmark = pytest.mark.session_exclusive

MODEL = "SmolLM2-135M-Instruct"
PASSWORD = "Test-password-1"


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    realm = Realm(running)
    for name in ("eve", "greedy", "busy"):
        realm.ensure_user(name, PASSWORD, ["user"])
    return realm


@pytest.fixture(scope="module")
def eve(realm: Realm) -> dict[str, str]:
    return {"Authorization": f"Bearer {realm.token('eve', PASSWORD)}"}


def records(running: Running) -> list[dict]:
    return [json.loads(line) for path in log_files(running.appliance.home.audit)
            for line in path.read_bytes().splitlines()]


def record_of(running: Running, response: httpx.Response) -> dict:
    [record] = [r for r in records(running) if r["request_id"] == response.headers["x-request-id"]]
    return record


def verified(running: Running) -> None:
    result = running.appliance.run("audit", "verify", timeout=120)
    assert result.returncode == 0 and "audit log OK" in result.stdout, result.stdout + result.stderr


def sse_events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines()
            if line.startswith("data: {")]


# -- 1. no request without its record ---------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("prompt", [rb"Hello \ud800 there", rb"Hello \u0000 there"], ids=["surrogate", "nul"])
def test_any_text_in_the_prompt_is_recorded_losslessly(realm: Realm, eve: dict, running: Running,
                                                       stream: bool, prompt: bytes) -> None:
    """Whatever the engine makes of it (vLLM's tokenizer refuses a lone surrogate with a 400),
    the request has its record, with the prompt's hash, and the chain verifies. Before, the
    surrogate made the record unencodable: no record, and a writer that stopped for everyone."""
    body = (b'{"model": "%s", "prompt": "%s", "max_tokens": 4, "temperature": 0, "stream": %s}'
            % (MODEL.encode(), prompt, b"true" if stream else b"false"))  # by hand: JSON encoders refuse it
    response = httpx.post(f"{realm.gateway}/v1/completions", content=body, timeout=120,
                          headers={**eve, "Content-Type": "application/json"})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 200 and stream:
        assert response.text.rstrip().endswith("data: [DONE]")
    record = record_of(running, response)
    assert record["status"] == response.status_code and record["prompt_hmac"]
    if response.status_code == 200:
        assert record["completion_tokens"] > 0 and record["completion_hmac"]
    assert httpx.get(f"{realm.gateway}/v1/models", headers=eve).status_code == 200, "the writer goes on"
    verified(running)


# -- 2. the record says what the engine saw ---------------------------------------------------

def test_a_second_prompt_field_or_an_unknown_field_is_refused(realm: Realm, eve: dict) -> None:
    forged = httpx.post(f"{realm.gateway}/v1/completions", headers=eve, timeout=60,
                        json={"model": MODEL, "prompt": "what the engine sees", "stream": True,
                              "messages": [{"role": "user", "content": "what the audit would record"}]})
    assert forged.status_code == 400
    error = forged.json()["error"]
    assert error["param"] == "messages" and "unknown field 'messages'" in error["message"]
    unknown = httpx.post(f"{realm.gateway}/v1/chat/completions", headers=eve, timeout=60,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                               "chat_template": "{{x}}"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "chat_template"
    for broken, says in ((b'{"model": ', "not valid JSON"),
                         (b'{"messages": [' + b"[" * 5000 + b"]" * 5000 + b"]}", "")):
        refused = httpx.post(f"{realm.gateway}/v1/chat/completions", content=broken, timeout=60,
                             headers={**eve, "Content-Type": "application/json"})
        assert refused.status_code == 400 and says in refused.json()["error"]["message"], refused.text


def test_the_prompt_hash_covers_the_tools_and_tool_calls_are_recorded_in_order(realm: Realm, eve: dict,
                                                                                running: Running) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                       "required": ["city"]}}}]
    chat = {"model": MODEL, "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the weather in Oslo?"}]}
    plain = httpx.post(f"{realm.gateway}/v1/chat/completions", headers=eve, json=chat, timeout=120)
    called = httpx.post(f"{realm.gateway}/v1/chat/completions", headers=eve, timeout=300,
                        json={**chat, "tools": tools, "max_tokens": 64,
                              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    # vLLM 0.32's named choice does not hold the demo model to the schema: its arguments here are a
    # JSON string, not an object, and the gateway refuses the call (serve.tool_calls). Recorded all the same.
    assert plain.status_code == 200 and called.status_code == 502, called.text
    assert called.json()["error"]["code"] == "invalid_tool_call" and "tool_calls" not in called.text
    plain_record, called_record = record_of(running, plain), record_of(running, called)
    assert plain_record["prompt_hmac"] != called_record["prompt_hmac"], "the tools shape the prompt"
    assert called_record["tools_called"] == ["get_weather"] and plain_record["tools_called"] is None


# -- 3. the end of a stream is found by parsing ------------------------------------------------

def test_an_end_marker_echoed_from_the_prompt_does_not_close_the_record_early(realm: Realm, eve: dict,
                                                                              running: Running) -> None:
    response = httpx.post(f"{realm.gateway}/v1/completions", headers=eve, timeout=120,
                          json={"model": MODEL, "prompt": "data: [DONE]\n\ndata: [DONE]", "echo": True,
                                "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True})
    assert response.status_code == 200
    usage = [event["usage"] for event in sse_events(response) if event.get("usage")][-1]
    record = record_of(running, response)
    assert record["completion_tokens"] == usage["completion_tokens"] == 8, "recorded after the real end"
    assert record["prompt_tokens"] == usage["prompt_tokens"]


# -- 4. the log cannot be flooded -------------------------------------------------------------

def test_a_flood_of_refused_requests_with_long_paths_grows_the_log_by_a_bounded_amount(
        realm: Realm, running: Running) -> None:
    """The log grows by the intervals the flood spans, not by its requests: per interval, the first
    refusal of each status has its own record and the rest one summary (serve.summaries), each
    record about a kilobyte however long the path."""
    path = "/v1/" + "A" * 65000  # about the longest URL httpx sends
    before = len(records(running))
    began = time.monotonic()
    with httpx.Client(timeout=30) as http:
        statuses = {http.get(f"{realm.gateway}{path}").status_code for _ in range(200)}
        statuses |= {http.get(f"{realm.gateway}/v1/models").status_code for _ in range(200)}
    spanned = int((time.monotonic() - began) // REFUSAL_INTERVAL_S) + 2  # whole intervals, and the two ends
    assert statuses <= {401, 404}, "no such route (no token asked), or no token"

    def flood() -> list[dict]:
        return [r for r in records(running)[before:] if r["status"] in (401, 404) and r["username"] is None]

    # Each refusal is in the log once its interval's summary comes (the session's interval: 10 s).
    until(lambda: sum(r.get("count") or 1 for r in flood()) >= 400, "the flood's summaries", 60, interval_s=0.5)
    written = flood()
    assert len(written) <= 2 * len(statuses) * spanned, f"{len(written)} records over {spanned} intervals"
    # A record of a 65 KB path is about 1,000 bytes: its resource is cut to 256 (serve.summaries.cap_text).
    assert all(len(json.dumps(r, separators=(",", ":")).encode()) < 1536 for r in written), "a record stays small"
    long_ones = [r for r in written if r["resource"] and "/v1/AAAA" in r["resource"]]
    assert long_ones and all(len(r["resource"].encode()) <= 256 for r in long_ones)
    assert any(r["action"] == "refused.summary" for r in written)


def test_anonymous_readiness_checks_change_nothing(realm: Realm, running: Running) -> None:
    def fetches() -> float:
        text = gateway_metrics(realm.gateway, realm.running.appliance.home)
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("gateway_jwks_fetches_total"))

    before = fetches()
    with httpx.Client() as http:
        answers = [http.get(f"{realm.gateway}/readyz") for _ in range(50)]
    assert {a.status_code for a in answers} == {200} and fetches() == before, "no key refetch from /readyz"


def test_a_page_of_the_newest_audit_records(realm: Realm, running: Running) -> None:
    admin = {"Authorization": f"Bearer {realm.admin_token()}"}
    page = httpx.get(f"{realm.gateway}/admin/audit", params={"newest": True, "limit": 3}, headers=admin)
    assert page.status_code == 200
    seqs = [r["seq"] for r in page.json()]
    assert len(seqs) == 3 and seqs == sorted(seqs, reverse=True)


# -- 5. limits that hold ----------------------------------------------------------------------

def test_parallel_streams_cannot_pass_the_token_budget(realm: Realm, running: Running) -> None:
    """The session gives role `user` 4,000 tokens a minute: each stream reserves 2 x 900 tokens
    and its prompt, so two fit; before, all 60 passed."""
    headers = {"Authorization": f"Bearer {realm.token('greedy', PASSWORD)}"}
    body = {"model": MODEL, "stream": True, "max_tokens": 900, "n": 2, "ignore_eos": True,
            "prompt": "Once upon a time"}
    start, answered = threading.Barrier(60), threading.Barrier(60)

    def one(_: int) -> tuple[int, str | None]:
        with httpx.Client(timeout=120) as http:
            start.wait()
            with http.stream("POST", f"{realm.gateway}/v1/completions", json=body, headers=headers) as response:
                answered.wait(60)  # the admitted streams stay open until every request is answered
                if response.status_code == 200:
                    next(response.iter_lines())  # admitted and generating; then the client leaves
                    return 200, response.headers["x-request-id"]
                response.read()
                return response.status_code, response.json()["error"]["code"]

    with ThreadPoolExecutor(60) as pool:
        outcomes = list(pool.map(one, range(60)))
    admitted = [rid for status, rid in outcomes if status == 200]
    assert len(admitted) == 2, outcomes
    assert {code for status, code in outcomes if status != 200} <= {"rate_limit_exceeded",
                                                                    "concurrency_limit_exceeded"}

    def records_of_the_admitted() -> list[dict] | None:  # once the gateway noticed both clients left
        found = [r for r in records(running) if r["request_id"] in admitted]
        return found if len(found) >= 2 else None

    left = until(records_of_the_admitted, "records of the streams whose clients left", 30, interval_s=0.2)
    assert [r["status"] for r in left] == [499, 499]
    assert all(r["prompt_tokens"] > 0 and r["completion_tokens"] >= 0 for r in left), "charged for the prompt"
    again = httpx.post(f"{realm.gateway}/v1/completions", headers=headers, timeout=120,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 900, "n": 2, "stop": [" "]})
    assert again.status_code == 200, "what the clients that left did not use was refunded"


def test_concurrent_requests_per_user_and_role_caps(realm: Realm, running: Running) -> None:
    headers = {"Authorization": f"Bearer {realm.token('busy', PASSWORD)}"}
    body = {"model": MODEL, "stream": True, "max_tokens": 200, "ignore_eos": True, "prompt": "Count:"}
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=20)) as http:
        streams = [http.stream("POST", f"{realm.gateway}/v1/completions", json=body, headers=headers)
                   for _ in range(8)]
        opened = [stream.__enter__() for stream in streams]
        try:
            assert [r.status_code for r in opened] == [200] * 8
            ninth = http.post(f"{realm.gateway}/v1/completions", json={**body, "stream": False}, headers=headers)
            assert ninth.status_code == 429 and ninth.json()["error"]["code"] == "concurrency_limit_exceeded"
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)
        # The gateway noticed the clients left: each stream's slot is given back before its record.
        closed = {r.headers["x-request-id"] for r in opened}
        until(lambda: len({r["request_id"] for r in records(running)} & closed) == len(closed),
              "records of the closed streams", 30, interval_s=0.2)
        for field, value in (("n", 3), ("logprobs", 3), ("prompt_logprobs", 5)):
            capped = http.post(f"{realm.gateway}/v1/completions", headers=headers,
                               json={"model": MODEL, "prompt": "x", "max_tokens": 2, field: value})
            assert capped.status_code == 400 and capped.json()["error"]["param"] == field
        after = http.post(f"{realm.gateway}/v1/completions", json={**body, "stream": False, "max_tokens": 2},
                          headers=headers)
        assert after.status_code == 200, "slots freed when the streams were closed"


# -- 6. Keycloak's keys and the gateway's client secret only over an authenticated channel -----

def test_keycloak_speaks_only_tls_with_a_certificate_from_the_appliance_ca(realm: Realm, running: Running) -> None:
    keycloak = realm.settings.keycloak
    [info] = [p for p in Supervisor(running.appliance.home).processes() if p.name == "keycloak"]
    program = psutil.Process(info.pid)  # kc.sh, or the JVM it became
    listening = {c.laddr for process in (program, *program.children(recursive=True))
                 for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    assert {address.ip for address in listening} <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening
    assert keycloak.port in {address.port for address in listening}
    discovery = f"{realm.issuer}/.well-known/openid-configuration"
    try:
        plain = httpx.get(f"http://127.0.0.1:{keycloak.port}/realms/{keycloak.realm}", timeout=10)
        assert plain.status_code != 200, "a plain-HTTP listener answers"
    except httpx.HTTPError:
        pass  # the TLS listener does not speak plain HTTP at all
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(discovery, timeout=10)  # the system's trust store does not know the appliance's CA
    assert httpx.get(discovery, timeout=10, verify=realm.tls).json()["issuer"] == realm.issuer


def test_a_process_on_keycloaks_port_while_it_restarts_gets_no_secret_and_no_say(
        realm: Realm, running: Running, tmp_path: Path) -> None:
    """Keycloak is stopped; a local process takes its port, plain or with a certificate of its own,
    and would answer every introspection `active`. The gateway's check of a fresh token reaches it,
    fails the handshake and answers 503: no client secret, no request, no say over the token."""
    home = running.appliance.home
    keycloak = realm.settings.keycloak
    token = realm.token("eve", PASSWORD)  # never used yet: its first request is introspected
    headers = {"Authorization": f"Bearer {token}"}
    own_certificate = ensure_server_certificate(Home(tmp_path / "attacker").ensure(), "keycloak")
    basic = base64.b64encode(f"{keycloak.gateway_client_id}:{gateway_client_secret(realm.settings, home)}".encode())
    supervisor = Supervisor(home)
    supervisor.call("stopProcess", "keycloak", True)
    try:
        for certificate in (None, own_certificate):
            with Impostor(keycloak.port, certificate) as impostor:
                refused = httpx.get(f"{realm.gateway}/v1/models", headers=headers, timeout=30)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "introspection_unavailable"
            assert impostor.received, "the gateway did not try Keycloak's port: the attack was not made"
            sent = impostor.everything()
            assert basic not in sent and b"HTTP/1.1" not in sent and b"token=" not in sent
    finally:
        supervisor.call("startProcess", "keycloak", True)
        ready = f"https://127.0.0.1:{keycloak.management_port}/health/ready"

        def answers_ready() -> bool:
            try:
                return httpx.get(ready, verify=realm.tls, timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        until(answers_ready, "Keycloak ready again", keycloak.start_timeout_s, interval_s=1)
    assert httpx.get(f"{realm.gateway}/v1/models", headers=headers, timeout=30).status_code == 200


# -- 11. connection floods --------------------------------------------------------------------

def test_half_open_connections_do_not_lock_out_a_real_client(realm: Realm, eve: dict, running: Running) -> None:
    """1,100 connections that never finish their request headers: past the session's cap of
    1,024 the oldest are closed at once, the rest after the 3 s header timeout, and a real
    request completes meanwhile. Before, uvicorn held them all and ran out of descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    port = running.appliance.port("APPLIANCE_GATEWAY__PORT")
    half_open: list[socket.socket] = []
    try:
        for _ in range(1100):
            connection = socket.create_connection(("127.0.0.1", port), timeout=10)
            connection.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\n")  # never finished
            half_open.append(connection)
        answer = httpx.get(f"{realm.gateway}/v1/models", headers=eve, timeout=30)
        assert answer.status_code == 200
        # Each is closed, by the cap or at its header deadline: awaited (the wait only bounds a hang).
        deadline = time.monotonic() + 60
        closed = 0
        for connection in half_open:
            connection.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                closed += connection.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass
        assert closed == len(half_open), f"{len(half_open) - closed} half-open connections still held"
    finally:
        for connection in half_open:
            connection.close()


# -- 12. a second attack ------------------------------------------------------------------------

def test_a_list_of_prompts_counts_each_prompt_against_max_n(realm: Realm, eve: dict, running: Running) -> None:
    """Role `user` may have 2 choices a request: 16 prompts are 16 choices, refused before the
    engine sees them; two prompts are two choices, answered, and reserved as two."""
    many = httpx.post(f"{realm.gateway}/v1/completions", headers=eve, timeout=60,
                      json={"model": MODEL, "prompt": ["Hi"] * 16, "n": 1, "max_tokens": 1})
    assert many.status_code == 400 and many.json()["error"]["param"] == "prompt", many.text
    assert "16 prompts" in many.json()["error"]["message"]
    two = httpx.post(f"{realm.gateway}/v1/completions", headers=eve, timeout=120,
                     json={"model": MODEL, "prompt": ["Hi", "Bye"], "max_tokens": 2, "temperature": 0})
    assert two.status_code == 200 and len(two.json()["choices"]) == 2
    doubled = httpx.post(f"{realm.gateway}/v1/completions", headers=eve, timeout=60,
                         json={"model": MODEL, "prompt": ["Hi", "Bye"], "n": 2, "max_tokens": 1})
    assert doubled.status_code == 400 and "4 choices" in doubled.json()["error"]["message"]


def test_the_recorded_source_is_the_peer_whatever_it_forwards(realm: Realm, eve: dict, running: Running) -> None:
    """No proxy is trusted by default, not even on loopback: X-Forwarded-For is ignored."""
    forged = httpx.get(f"{realm.gateway}/v1/models", timeout=30,
                       headers={**eve, "X-Forwarded-For": "203.0.113.9", "Forwarded": "for=203.0.113.9"})
    assert forged.status_code == 200
    assert record_of(running, forged)["source"] == "127.0.0.1"


def test_the_parameters_hash_tells_apart_requests_with_one_prompt(realm: Realm, eve: dict, running: Running) -> None:
    """Fields that change the answer but not the prompt (logit bias, stop strings, n...) are
    covered by the record's parameters hash."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    plain = httpx.post(f"{realm.gateway}/v1/completions", headers=eve, timeout=120, json=body)
    biased = httpx.post(f"{realm.gateway}/v1/completions", headers=eve, timeout=120,
                        json={**body, "logit_bias": {"42": 50}, "stop": ["x"], "min_tokens": 1})
    assert plain.status_code == biased.status_code == 200, biased.text
    first, second = record_of(running, plain), record_of(running, biased)
    assert first["prompt_hmac"] == second["prompt_hmac"]
    assert first["params_hmac"] and first["params_hmac"] != second["params_hmac"]


def _raw_request(port: int, head: bytes) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    connection.sendall(head)
    return connection


def _closed_within(connection: socket.socket, seconds: float) -> bytes:
    """What the gateway sent before it closed the connection (fails if it did not, in time)."""
    connection.settimeout(seconds)
    received = b""
    while chunk := connection.recv(65536):
        received += chunk
    return received


def test_an_anonymous_upload_is_refused_before_its_body_is_read(realm: Realm, running: Running) -> None:
    """A 48 MiB multipart upload with no token: 401 as soon as its headers are in, and the
    connection closed; before, the gateway read and spooled all of it first."""
    port = running.appliance.port("APPLIANCE_GATEWAY__PORT")
    connection = _raw_request(port, b"POST /v1/files HTTP/1.1\r\nHost: gateway\r\nContent-Length: 50331648\r\n"
                                    b"Content-Type: multipart/form-data; boundary=x\r\n\r\n--x\r\n")
    try:
        answer = _closed_within(connection, 10)
    finally:
        connection.close()
    assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower()


def _slow_connections(realm: Realm) -> float:
    metrics = gateway_metrics(realm.gateway, realm.running.appliance.home)
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith('gateway_slow_connections_closed_total{reason="body"}'))


def test_a_stalled_or_trickled_body_is_closed_counted_and_recorded(realm: Realm, eve: dict,
                                                                   running: Running) -> None:
    """The session's body deadline is 3 s (and 4 KiB/s after it): a body that stops, and one
    sent a byte every half second, are closed while their bodies are far from whole (the trickle
    still going), counted in /metrics and summarised in the audit log by their source; a client
    is served while they are held."""
    port = running.appliance.port("APPLIANCE_GATEWAY__PORT")
    before = _slow_connections(realm)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: {eve['Authorization']}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{").encode()
    stalled, trickled = _raw_request(port, head), _raw_request(port, head)
    try:
        assert httpx.get(f"{realm.gateway}/v1/models", headers=eve, timeout=30).status_code == 200
        sent = 1
        while sent < 120:  # the trickle under test, until the gateway closes it (a minute bounds a hang)
            try:
                trickled.sendall(b" ")
                if trickled.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                    break
            except BlockingIOError:
                pass
            except OSError:
                break
            sent += 1
            time.sleep(0.5)
        assert sent < 120, "the trickle was never closed"
        _closed_within(stalled, 10)
        _closed_within(trickled, 10)
    finally:
        stalled.close()
        trickled.close()
    until(lambda: _slow_connections(realm) >= before + 2, "the slow bodies counted", 30, interval_s=0.2)
    until(lambda: any(r["action"] in ("connection.closed_slow", "refused.summary") and r["status"] == 408
                      and r["source"] == "127.0.0.1" for r in records(running)),
          "the slow bodies in the audit log", 30, interval_s=0.2)
    verified(running)
