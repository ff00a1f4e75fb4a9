"""The gateway against real Keycloak, real vLLM and real supervisord."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwcrypto import jwk
from openai.types.chat import ChatCompletionMessageParam

from tests.integration.conftest import Running, engine_client
from tests.integration.realm import Realm, b64, parts
from tests.support.scrape import gateway_metrics
from tests.support.waiting import until

# It counts the requests the session's engine holds and spends users' rate limits.
pytestmark = pytest.mark.session_exclusive

MODEL = "SmolLM2-135M-Instruct"
PASSWORD = "Test-password-1"


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    realm = Realm(running)
    realm.ensure_user("alice", PASSWORD, ["user"])
    realm.ensure_user("bob", PASSWORD, [])
    realm.ensure_user("mallory", PASSWORD, ["trainer"])
    realm.ensure_user("limited", PASSWORD, ["user"])
    # A client whose tokens do not name the gateway in `aud`.
    realm.ensure_client("other-app")
    # A client whose tokens live one second: real expired tokens.
    realm.ensure_client("short-lived", attributes={"access.token.lifespan": "1"},
                        protocolMappers=[{"name": "gateway-audience", "protocol": "openid-connect",
                                          "protocolMapper": "oidc-audience-mapper",
                                          "config": {"included.client.audience": "appliance-gateway",
                                                     "access.token.claim": "true"}}])
    return realm


@pytest.fixture(scope="module")
def alice(realm: Realm) -> str:
    return realm.token("alice", PASSWORD)


def client(realm: Realm, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{realm.gateway}/v1", api_key=token, max_retries=0, timeout=120)


def test_openai_client_lists_models_and_chats(realm: Realm, alice: str) -> None:
    api = client(realm, alice)
    assert [m.id for m in api.models.list()] == [MODEL]
    reply = api.chat.completions.create(model=MODEL, temperature=0, max_tokens=16,
                                        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0


def test_openai_client_streams_token_by_token(realm: Realm, alice: str) -> None:
    api = client(realm, alice)
    pieces = [chunk.choices[0].delta.content for chunk in api.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=16, stream=True,
        messages=[{"role": "user", "content": "What is the capital of France?"}]) if chunk.choices]
    text = "".join(p for p in pieces if p)
    assert len([p for p in pieces if p]) > 3 and "Paris" in text


def test_completions_route(realm: Realm, alice: str) -> None:
    api = client(realm, alice)
    prompt = "The capital of France is"
    out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    [choice] = out.choices
    assert out.model == MODEL and choice.text.strip()
    assert out.usage is not None and out.usage.prompt_tokens > 0
    # max_tokens bounds the answer, and an answer cut there says so.
    assert choice.finish_reason in ("length", "stop")
    assert 0 < out.usage.completion_tokens <= 5
    assert choice.finish_reason == "stop" or out.usage.completion_tokens == 5, (choice, out.usage)
    # Greedy decoding: a shorter answer to the same prompt is the start of this one.
    shorter = api.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert shorter.usage is not None and shorter.usage.completion_tokens <= 2
    assert choice.text.startswith(shorter.choices[0].text), (shorter.choices[0].text, choice.text)


def bad_tokens(realm: Realm, alice: str) -> dict[str, tuple[str | None, int, str]]:
    """name -> (Authorization header, expected status, expected error code)."""
    head, body, sig = alice.split(".")
    claims = parts(alice)[1]
    other_key = jwk.JWK.from_pyca(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    realm_kid = parts(alice)[0]["kid"]
    public_pem = jwk.JWKSet.from_json(httpx.get(f"{realm.issuer}/protocol/openid-connect/certs", verify=realm.tls).text
                                      ).get_key(realm_kid).export_to_pem()
    hs = jwk.JWK(kty="oct", k=b64(public_pem))
    tokens = realm.token_response("alice", PASSWORD, scope="openid")
    master = realm.token_response("kcadmin", _kcadmin_password(realm), client_id="admin-cli",
                                  realm_issuer=realm.issuer.rsplit("/realms/", 1)[0] + "/realms/master")
    short = realm.token("alice", PASSWORD, client_id="short-lived")
    # Aged past its exp (a 1 s lifetime) and the session's leeway, by the clock the gateway reads
    # (a second more: exp is in whole seconds).
    expired_at = parts(short)[1]["exp"] + realm.settings.gateway.leeway_s + 1
    until(lambda: time.time() >= expired_at, "the short-lived token to expire", 30, interval_s=0.1)
    return {
        "no token": (None, 401, "missing_token"),
        "bearer without token": ("Bearer", 401, "malformed"),
        "basic scheme": ("Basic YWxpY2U6cHc=", 401, "malformed"),
        "garbage": ("Bearer not-a-jwt", 401, "malformed"),
        "two parts": (f"Bearer {head}.{body}", 401, "malformed"),
        "alg none": (f"Bearer {b64({'alg': 'none', 'typ': 'JWT', 'kid': realm_kid})}.{body}.", 401, "bad_algorithm"),
        "hs256 with realm public key": (f"Bearer {realm.craft(claims, key=hs, kid=realm_kid, alg='HS256')}", 401,
                                        "bad_algorithm"),
        "payload altered": (f"Bearer {head}.{b64({**claims, 'realm_access': {'roles': ['admin', 'user']}})}.{sig}",
                            401, "bad_signature"),
        "signature stripped": (f"Bearer {head}.{body}.", 401, "bad_signature"),
        "header alg swapped": (f"Bearer {b64({**parts(alice)[0], 'alg': 'RS512'})}.{body}.{sig}", 401, "bad_signature"),
        "another key, realm kid": (f"Bearer {realm.craft(claims, key=other_key, kid=realm_kid)}", 401, "bad_signature"),
        "unknown kid": (f"Bearer {realm.craft(claims, key=other_key, kid='no-such-key')}", 401, "unknown_key"),
        "no kid": (f"Bearer {b64({'alg': 'RS256', 'typ': 'JWT'})}.{body}.{sig}", 401, "unknown_key"),
        "expired (real, 1 s lifetime)": (f"Bearer {short}", 401, "expired"),
        "expired (crafted)": (f"Bearer {realm.craft(realm.good_claims(exp=int(time.time()) - 60))}", 401, "expired"),
        "not yet valid": (f"Bearer {realm.craft(realm.good_claims(nbf=int(time.time()) + 600))}", 401, "not_yet_valid"),
        "realm master token": (f"Bearer {master['access_token']}", 401, "unknown_key"),
        "wrong issuer (trusted key)": (
            f"Bearer {realm.craft(realm.good_claims(iss=realm.issuer.replace('appliance', 'master')))}", 401,
            "bad_issuer"),
        "wrong audience": (f"Bearer {realm.token('alice', PASSWORD, client_id='other-app')}", 401, "bad_audience"),
        "id token": (f"Bearer {tokens['id_token']}", 401, "bad_audience"),
        "id token typ (trusted key)": (f"Bearer {realm.craft(realm.good_claims(typ='ID'))}", 401, "bad_type"),
        "refresh token": (f"Bearer {tokens['refresh_token']}", 401, "bad_algorithm"),
        "no subject": (f"Bearer {realm.craft(realm.good_claims(sub=None))}", 401, "malformed"),
        "no expiry": (f"Bearer {realm.craft(realm.good_claims(exp=None))}", 401, "malformed"),
        "valid claims, unknown session": (f"Bearer {realm.craft(realm.good_claims())}", 401, "inactive"),
        "user without any role": (f"Bearer {realm.token('bob', PASSWORD)}", 403, "missing_role"),
        "user with another role": (f"Bearer {realm.token('mallory', PASSWORD)}", 403, "missing_role"),
    }


def _kcadmin_password(realm: Realm) -> str:
    from appliance.secrets import secret
    from installer.keycloak import ADMIN_SECRET

    return secret(realm.running.appliance.home, ADMIN_SECRET)


def test_bad_tokens_are_rejected(realm: Realm, alice: str) -> None:
    cases = bad_tokens(realm, alice)
    assert len(cases) >= 20
    assert httpx.get(f"{realm.gateway}/readyz").status_code == 200
    # The test's realm key is newer than the gateway's cached JWKS: the gateway refetches the keys
    # on an unknown kid, at most once per gateway.jwks_refetch_interval_s (the last fetch may have
    # been the gateway's start, moments ago).
    crafted = {"Authorization": cases["expired (crafted)"][0] or ""}
    until(lambda: httpx.get(f"{realm.gateway}/v1/models", headers=crafted, timeout=30).json()["error"]["code"]
          != "unknown_key", "the gateway to fetch the realm's new key",
          realm.settings.gateway.jwks_refetch_interval_s + 10, interval_s=1)
    failures = []
    for name, (authorization, status, code) in cases.items():
        headers = {"Authorization": authorization} if authorization is not None else {}
        response = httpx.get(f"{realm.gateway}/v1/models", headers=headers, timeout=30)
        error = response.json().get("error", {})
        if (response.status_code, error.get("code")) != (status, code):
            failures.append(f"{name}: {response.status_code} {error}")
        if status == 401 and not response.headers.get("www-authenticate", "").startswith("Bearer"):
            failures.append(f"{name}: no WWW-Authenticate")
    assert not failures, "\n".join(failures)
    metrics = gateway_metrics(realm.gateway, realm.running.appliance.home)
    assert 'gateway_auth_failures_total{reason="bad_signature"}' in metrics


def test_disabled_users_fresh_token_stops_working(realm: Realm) -> None:
    user_id = realm.ensure_user("carol", PASSWORD, ["user"])
    token = realm.token("carol", PASSWORD)
    assert httpx.get(f"{realm.gateway}/v1/models", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    realm.admin.update_user(user_id, {"enabled": False})
    # The token's introspection, cached before the user was disabled, has lived its time (the
    # session's gateway.introspect_ttl_s) once that long has passed since: the next request asks again.
    cached_until = time.monotonic() + realm.settings.gateway.introspect_ttl_s
    until(lambda: time.monotonic() >= cached_until, "the introspection cache's time to pass", 30, interval_s=0.1)
    response = httpx.get(f"{realm.gateway}/v1/models", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "inactive"


def test_openai_error_shapes(realm: Realm, alice: str) -> None:
    headers = {"Authorization": f"Bearer {alice}"}
    unknown = httpx.post(f"{realm.gateway}/v1/chat/completions", headers=headers,
                         json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    # Other modules may have deployed adapters alice's role may use: they are listed too.
    assert error["message"].startswith("model 'no-such-model' does not exist; models available to you: ")
    assert MODEL in error["message"].split(": ", 1)[1].split(", ")
    assert {key: error[key] for key in ("type", "param", "code")} == {"type": "invalid_request_error",
                                                                       "param": None, "code": "model_not_found"}
    big = httpx.post(f"{realm.gateway}/v1/chat/completions", headers=headers,
                     content=b'{"model": "' + b"x" * 2_000_000 + b'"}')
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert big.headers.get("x-request-id")

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is found while reading
        yield b'{"model": "'
        for _ in range(20):
            yield b"x" * 100_000

    chunked = httpx.post(f"{realm.gateway}/v1/chat/completions", headers=headers, content=chunks())
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"


def test_engine_and_validation_errors_reach_the_openai_client_in_openais_shape(realm: Realm, alice: str) -> None:
    """vLLM's own 400 (`top_logprobs` without `logprobs`: within the role's cap, so the gateway lets
    it through, and vLLM refuses it as a `BadRequestError` with a numeric code), streamed or not,
    and the gateway's refusal of a bad `tools` entry both come back as OpenAI's error object with
    string codes; the model list names the model, never the path of its checkpoint."""
    api = client(realm, alice)
    hello: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]

    def refused(messages: list[ChatCompletionMessageParam], **request: Any) -> dict[str, Any]:
        """The error object of a chat request the client raised BadRequestError for."""
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(model=MODEL, max_tokens=8, messages=messages, **request)
        body = caught.value.body
        assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}, body
        assert isinstance(body["code"], str) and body["type"] == "invalid_request_error", body
        assert "\n" not in body["message"] and "/" not in body["message"], body
        return body

    for stream in (False, True):
        engine = refused(hello, stream=stream, logprobs=False, top_logprobs=2)
        assert (engine["code"], engine["param"]) == ("invalid_value", "top_logprobs"), engine
        assert "`logprobs` must be set to true" in engine["message"], engine
        assert "validation error" not in engine["message"] and "{" not in engine["message"], engine
    tool = refused(hello, tools=[{"type": "function", "function": {"description": "no name"}}])
    assert tool == {"message": "'tools.0.function.name': Field required", "type": "invalid_request_error",
                    "param": "tools.0.function.name", "code": "missing_required_parameter"}
    [model] = [entry for entry in httpx.get(f"{realm.gateway}/v1/models", headers={
        "Authorization": f"Bearer {alice}"}, timeout=30).json()["data"] if entry["id"] == MODEL]
    assert model["root"] == MODEL and model["parent"] is None and model["object"] == "model", model
    assert not any("/" in str(value) for value in model.values()), model


def test_a_corrupt_adapter_registry_is_a_clear_503_not_a_plain_500(realm: Realm, alice: str,
                                                                   running: Running) -> None:
    """Regression: a damaged adapters.json made every chat request a plain-text 500."""
    registry = running.appliance.home.root / "adapters.json"
    kept = registry.read_bytes() if registry.exists() else None
    headers = {"Authorization": f"Bearer {alice}"}
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    try:
        registry.write_text('{"adapters": [')
        broken = httpx.post(f"{realm.gateway}/v1/chat/completions", headers=headers, json=chat, timeout=60)
        assert broken.status_code == 503 and broken.headers["content-type"] == "application/json"
        error = broken.json()["error"]
        assert error["code"] == "state" and "adapters.json" in error["message"], error
        assert broken.headers["retry-after"]
    finally:
        if kept is None:
            registry.unlink()
        else:
            registry.write_bytes(kept)
    assert httpx.post(f"{realm.gateway}/v1/chat/completions", headers=headers, json=chat,
                      timeout=60).status_code == 200


def test_rate_limit_answers_429_then_recovers(realm: Realm) -> None:
    headers = {"Authorization": f"Bearer {realm.token('limited', PASSWORD)}"}
    statuses = []
    for _ in range(70):  # the session allows role `user` 60 requests per minute
        response = httpx.get(f"{realm.gateway}/v1/models", headers=headers)
        statuses.append(response.status_code)
        if response.status_code == 429:
            break
    assert statuses[-1] == 429, statuses
    retry_after = int(response.headers["retry-after"])
    assert 1 <= retry_after <= 60
    assert response.json()["error"]["type"] == "rate_limit_error"
    time.sleep(retry_after)  # the client waits as it is told: the Retry-After under test
    assert httpx.get(f"{realm.gateway}/v1/models", headers=headers).status_code == 200


def running_requests(running: Running) -> float:
    """Requests the engine holds: running, or waiting (a request can be preempted back to waiting)."""
    with engine_client(running.appliance) as http:
        text = http.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))


def until_engine_holds(running: Running, count: float, timeout_s: float) -> None:
    """Wait until the engine holds `count` requests (its gauges are updated once a step)."""
    until(lambda: running_requests(running) == count,
          lambda: f"the engine to hold {count} requests; it holds {running_requests(running)}", timeout_s,
          interval_s=0.2)


def test_client_disconnect_mid_stream_frees_the_engine(realm: Realm, alice: str, running: Running) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": 1500, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    with httpx.stream("POST", f"{realm.gateway}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {alice}"}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        until_engine_holds(running, 1, 60)
    until_engine_holds(running, 0, 30)


def test_health_and_readiness(realm: Realm) -> None:
    assert httpx.get(f"{realm.gateway}/healthz").json() == {"status": "ok", "checks": {}, "reason": None}
    ready = httpx.get(f"{realm.gateway}/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"engines": True, "jwks": True, "audit": True}  # names no replica
    metrics = gateway_metrics(realm.gateway, realm.running.appliance.home)
    for name in ("gateway_requests_total", "gateway_request_seconds_bucket",
                 "gateway_time_to_first_token_seconds_bucket", "gateway_tokens_total",
                 "gateway_auth_failures_total"):
        assert name in metrics
    assert 'route="/v1/chat/completions",status="200"' in metrics
    # It names GPUs, queues and adapters: the monitoring password or an administrator, no one else.
    anonymous = httpx.get(f"{realm.gateway}/metrics")
    assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"].startswith("Bearer")
    wrong = httpx.get(f"{realm.gateway}/metrics", auth=("appliance", "not-the-password"))
    assert wrong.status_code == 401
    user = httpx.get(f"{realm.gateway}/metrics", headers={"Authorization": f"Bearer {realm.token('alice', PASSWORD)}"})
    assert user.status_code == 403 and user.json()["error"]["code"] == "missing_role", user.text
    key = httpx.get(f"{realm.gateway}/metrics", headers={"Authorization": "Bearer apk-" + "x" * 40})
    assert key.status_code == 403 and key.json()["error"]["code"] == "key_not_allowed", key.text
    admin = httpx.get(f"{realm.gateway}/metrics", headers={"Authorization": f"Bearer {realm.admin_token()}"})
    assert admin.status_code == 200 and "gateway_requests_total" in admin.text


def test_status_json_names_gateway_and_issuer(running: Running, realm: Realm) -> None:
    import json

    report = json.loads(running.appliance.run("status", "--json").stdout)
    [gateway] = [p for p in report["programs"] if p["name"] == "gateway"]
    assert gateway["urls"]["openai"] == f"{realm.gateway}/v1"
    assert gateway["urls"]["issuer"] == realm.issuer
    assert {p["name"] for p in report["programs"]} == {"postgres", "keycloak", "vllm-main", "gateway",
                                                       "finetune-worker", "rl-worker", "batch-worker",
                                                       "prometheus", "alertmanager", "watchdog"}


def test_tokens_and_secrets_never_reach_the_logs(realm: Realm, alice: str, running: Running) -> None:
    from appliance.secrets import secret

    home = running.appliance.home
    needles = [alice, secret(home, "engine-api-key"), secret(home, "gateway-client-secret")]
    for log in home.logs.glob("*.log"):
        text = log.read_text(errors="replace")
        for needle in needles:
            assert needle not in text, f"a token or secret is in {log}"
