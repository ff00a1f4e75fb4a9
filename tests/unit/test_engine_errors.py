"""One error vocabulary on /v1: the engine's (vLLM's) error bodies reach the client in OpenAI's
shape with string codes and no server paths, a body that does not validate (a bad `tools` entry
among them) is a one-line 400 naming the field's dotted path, `model_not_found` names the models
the caller may use, and /v1/models lists names, never the checkpoints' paths."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fastapi.testclient import TestClient
from pydantic import ValidationError

from appliance.home import Home
from appliance.settings import Settings
from serve.auth import Principal
from serve.errors import (
    MAX_LISTED_MODELS,
    GatewayError,
    ModelNotFound,
    engine_error,
    scrub_paths,
    stream_error,
    validation_error,
)
from serve.gateway import create_app
from serve.metrics import Metrics
from serve.replicas import Pool, Replica, engine_session
from serve.schemas import ChatRequest, CompletionRequest
from serve.upstream import Upstreams, model_entry, read_answer

MESSAGES = [{"role": "user", "content": "hi"}]
MODEL_PATH = "/data/appliance/models/llama-3-8b-instruct"
SHAPE = {"message", "type", "param", "code"}


def vllm_error(message: str, type: object = "BadRequestError", code: int = 400,
               param: str | None = None) -> dict[str, Any]:
    """An error body as vLLM 0.32 sends it (serve/exception_handling: numeric `code`)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def assert_openai_shaped(body: dict[str, Any]) -> dict[str, Any]:
    error: dict[str, Any] = body["error"]
    assert set(error) == SHAPE and isinstance(error["message"], str) and isinstance(error["type"], str)
    assert isinstance(error["code"], str) and (error["param"] is None or isinstance(error["param"], str))
    assert "\n" not in error["message"]
    return error


# -- the engine's errors ----------------------------------------------------------------------

@pytest.mark.parametrize(("status", "engine_type", "kind", "code"), [
    (400, "BadRequestError", "invalid_request_error", "invalid_value"),
    (400, "Bad Request", "invalid_request_error", "invalid_value"),  # vLLM's HTTP-phrase types
    (422, "UnprocessableEntityError", "invalid_request_error", "invalid_value"),
    (404, "NotFoundError", "not_found_error", "not_found"),
    (404, "Not Found", "not_found_error", "not_found"),
    (501, "NotImplementedError", "invalid_request_error", "not_supported"),
    (500, "InternalServerError", "server_error", "engine_error"),
    (503, "ServiceUnavailableError", "service_unavailable", "engine_unavailable"),
    (429, "SomethingNewError", "rate_limit_error", "engine_overloaded"),  # unknown type: by status
    (500, None, "server_error", "engine_error"),
    (409, 7, "invalid_request_error", "invalid_value"),
])
def test_each_engine_type_maps_to_openais_type_and_a_string_code(status: int, engine_type: object, kind: str,
                                                                   code: str) -> None:
    error = engine_error(status, vllm_error("it went wrong", type=engine_type, code=status))
    assert (error.status, error.type, error.code, error.message) == (status, kind, code, "it went wrong")


def test_an_engine_400_keeps_its_message_and_field_but_not_its_numeric_code() -> None:
    body = vllm_error("'logprobs' must be between 0 and 20", param="logprobs")
    error = assert_openai_shaped(engine_error(400, body).body())
    assert error == {"message": "'logprobs' must be between 0 and 20", "type": "invalid_request_error",
                     "param": "logprobs", "code": "invalid_value"}


def test_a_prompt_past_the_context_is_openais_context_length_exceeded() -> None:
    body = vllm_error("This model's maximum context length is 512 tokens. However, your prompt contains "
                      "at least 513 input tokens, which exceeds this limit even without any output tokens. "
                      "Please reduce the length of the input prompt.", param="input_tokens")
    error = engine_error(400, body)
    assert error.code == "context_length_exceeded" and error.type == "invalid_request_error"
    assert error.param is None, "input_tokens is the engine's count, no field of the request"
    assert "512 tokens" in error.message


def test_vllms_dump_of_pydantic_errors_becomes_one_line_naming_the_field() -> None:
    dump = ("2 validation errors:\n  {'type': 'missing', 'loc': 'body.tools.0.function', 'msg': 'Field required', "
            "'input': {'type': 'function'}}\n  {'type': 'string_type', 'loc': 'body.model', 'msg': "
            "\"Input should be a valid string (it's not)\", 'input': 5}")
    error = engine_error(400, vllm_error(dump, type="Bad Request", param="body.tools.0.function"))
    assert (error.param, error.message, error.code) == ("tools.0.function", "'tools.0.function': Field required",
                                                        "invalid_value")
    unnamed = engine_error(400, vllm_error("1 validation error:\n  {'type': 'odd'}", type="Bad Request"))
    assert (unnamed.param, unnamed.message) == (None, "'body': invalid value")


@pytest.mark.parametrize("body", [None, "Internal Server Error", {"detail": "x"}, {"error": "text"}, []])
def test_an_engine_answer_not_in_vllms_error_shape_still_gets_one(body: object) -> None:
    error = engine_error(500, body)
    assert (error.type, error.code, error.param) == ("server_error", "engine_error", None)
    assert error.message == "the engine failed (HTTP 500)"
    assert engine_error(400, body).message == "the engine refused the request (HTTP 400)"


def test_server_paths_never_reach_the_client() -> None:
    message = (f"The model `{MODEL_PATH}` cannot load /opt/vllm/lib/tokenizer.json; see "
               "https://docs.vllm.ai/en/latest/usage/ or POST /v1/chat/completions instead")
    error = engine_error(404, vllm_error(message, type="NotFoundError", code=404))
    assert "/data/" not in error.message and "/opt/" not in error.message
    assert error.message == ("The model `<path>` cannot load <path>; see https://docs.vllm.ai/en/latest/usage/ "
                             "or POST /v1/chat/completions instead"), "URLs and the gateway's routes are no files"
    assert scrub_paths("a ~/models/x or ./models/x or a/b stays") == "a ~/models/x or ./models/x or a/b stays"


def test_a_huge_engine_message_is_cut() -> None:
    error = engine_error(400, vllm_error("x" * 100_000))
    assert len(error.message.encode()) <= 1024 and "bytes sha256:" in error.message


def test_a_streamed_error_event_takes_its_status_from_vllms_code() -> None:
    assert stream_error(vllm_error("boom", type="InternalServerError", code=500))["error"]["code"] == "engine_error"
    odd = stream_error({"error": {"message": "m", "code": "nope"}})
    assert odd["error"]["type"] == "server_error", "no status: the engine failed"


# -- the boundary: what comes back from an engine ---------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def answering(make: Callable[[], web.StreamResponse]) -> Handler:
    """A route handler answering what `make` builds, afresh each time."""
    async def handler(request: web.Request) -> web.StreamResponse:
        return make()
    return handler


async def stand_in_engine(path: Path, routes: Callable[[web.Application], None]) -> web.AppRunner:
    app = web.Application()
    app.router.add_get("/health", answering(lambda: web.Response(text="ok")))
    routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    return runner


def through_engine(tmp_path: Path, routes: Callable[[web.Application], None],
                   use: Callable[[Upstreams, Pool], Any]) -> Any:
    """Run `use` against upstreams whose one pool (model "llama") is a stand-in engine with `routes`."""
    pool = Pool(name="main", model="llama", replicas=(Replica("main", tmp_path / "main.sock"),))

    async def scenario() -> Any:
        runner = await stand_in_engine(tmp_path / "main.sock", routes)
        session = engine_session(pool.replicas[0], aiohttp.ClientTimeout(total=10, sock_connect=1))
        try:
            async with session:
                return await use(Upstreams([pool], {"main": session}, "key"), pool)
        finally:
            await runner.cleanup()

    return asyncio.run(scenario())


def test_an_engine_error_answer_is_translated_where_it_is_read(tmp_path: Path) -> None:
    def routes(app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", answering(lambda: web.json_response(
            vllm_error(f"model {MODEL_PATH}: 'top_logprobs' must be at most 20", param="top_logprobs"), status=400)))
        app.router.add_post("/v1/completions", answering(lambda: web.Response(text="Internal Server Error",
                                                                               status=500)))

    async def use(upstreams: Upstreams, pool: Pool) -> tuple[int, bytes, int, bytes]:
        answers = []
        for path in ("/v1/chat/completions", "/v1/completions"):
            sent = await upstreams.send(pool, path, b"{}", "r1")
            answers += [sent.response.status, await read_answer(sent.response, pool)]
            sent.done()
        return tuple(answers)  # type: ignore[return-value]

    status, content, failed_status, failed = through_engine(tmp_path, routes, use)
    error = assert_openai_shaped(json.loads(content))
    assert status == 400 and error == {"message": "model <path>: 'top_logprobs' must be at most 20",
                                       "type": "invalid_request_error", "param": "top_logprobs",
                                       "code": "invalid_value"}
    assert failed_status == 500 and assert_openai_shaped(json.loads(failed))["code"] == "engine_error"


def test_a_good_answer_passes_unchanged(tmp_path: Path) -> None:
    raw = b'{"choices": [{"index": 0, "message": {"content": "/data/x/y is a path"}}]}'

    def routes(app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", answering(lambda: web.Response(body=raw)))

    async def use(upstreams: Upstreams, pool: Pool) -> bytes:
        sent = await upstreams.send(pool, "/v1/chat/completions", b"{}", "r1")
        sent.done()
        return await read_answer(sent.response, pool)

    assert through_engine(tmp_path, routes, use) == raw, "the model's own text is not the engine's error"


def test_the_model_list_holds_names_never_paths(tmp_path: Path) -> None:
    listed = {"object": "list", "data": [
        {"id": "llama", "object": "model", "created": 1, "owned_by": "vllm", "root": MODEL_PATH, "parent": None,
         "max_model_len": 512, "permission": [{"id": "modelperm-1", "object": "model_permission"}]},
        {"id": "ada@3", "object": "model", "created": 1, "owned_by": "vllm", "root": "/data/appliance/adapters/ada/v3",
         "parent": "llama", "max_model_len": None, "permission": []},
        "not a model"]}

    def routes(app: web.Application) -> None:
        app.router.add_get("/v1/models", answering(lambda: web.json_response(listed)))

    async def use(upstreams: Upstreams, pool: Pool) -> list[dict[str, Any]]:
        return await upstreams.models()

    models = through_engine(tmp_path, routes, use)
    assert models == [{"id": "llama", "object": "model", "created": 1, "owned_by": "vllm", "max_model_len": 512,
                       "root": "llama", "parent": None}], "the engine's adapter versions are not listed"
    assert "/" not in json.dumps(models)


def test_a_model_entry_keeps_no_field_it_does_not_know() -> None:
    entry = model_entry({"id": "m", "root": "/srv/m", "parent": "/srv/base", "object": "x", "secret_path": "/a/b"})
    assert entry == {"id": "m", "object": "model", "root": "m", "parent": None}


# -- model_not_found ---------------------------------------------------------------------------

def test_model_not_found_names_the_served_models(tmp_path: Path) -> None:
    pools = [Pool(name=name, model=name, replicas=(Replica(name, tmp_path / f"{name}.sock"),))
             for name in ("zeta", "alpha")]
    with pytest.raises(ModelNotFound) as missing:
        Upstreams(pools, {}, "key").route("gpt-4o")
    error = assert_openai_shaped(missing.value.body())
    assert missing.value.status == 404 and error == {
        "message": "model 'gpt-4o' does not exist; models available to you: alpha, zeta",
        "type": "invalid_request_error", "param": None, "code": "model_not_found"}


def test_the_list_in_model_not_found_is_capped() -> None:
    names = [f"m{number:02}" for number in range(MAX_LISTED_MODELS + 5)]
    error = ModelNotFound("model 'x' does not exist", names)
    assert error.message.endswith(f"m{MAX_LISTED_MODELS - 1:02} and 5 more") and f"m{MAX_LISTED_MODELS:02}" \
        not in error.message
    assert ModelNotFound("model 'x' does not exist", []).message == "model 'x' does not exist; no model is " \
        "available to you"
    assert ModelNotFound("w", ["b"]).for_caller(["a", "b"], lambda name: True).usable == ["a", "b"], "sorted, once"
    assert ModelNotFound("w", ["b", "c"]).for_caller(["a"], lambda name: name != "b").usable == ["a", "c"], \
        "what an API key may not use is not named"


class Anyone:
    async def validate(self, header: str | None) -> Principal:
        return Principal(subject="s", username="u", client="c", roles=frozenset({"user"}), token_id="t",
                         expires_at=float("inf"))


class Adapters:
    def visible(self, roles: frozenset[str]) -> list[dict[str, str]]:
        return [{"id": "support-bot", "object": "model", "parent": "llama"}] if "user" in roles else []


@pytest.fixture
def client(home: Home) -> TestClient:
    """The gateway app without its lifespan (no Keycloak, no engine): bodies are refused before either."""
    app = create_app(Settings(), home)
    app.state.gateway = SimpleNamespace(validator=Anyone(), metrics=Metrics(), adapters=Adapters())

    async def missing() -> None:
        raise ModelNotFound("model 'gpt-4o' does not exist", ["llama"])

    app.add_api_route("/v1/missing", missing, name="test.missing")
    return TestClient(app, raise_server_exceptions=False)


def test_model_not_found_adds_the_adapters_the_caller_may_use(client: TestClient) -> None:
    answer = client.get("/v1/missing", headers={"Authorization": "Bearer x"})
    assert answer.status_code == 404
    assert assert_openai_shaped(answer.json())["message"] == ("model 'gpt-4o' does not exist; models available "
                                                              "to you: llama, support-bot")


# -- bodies that do not validate -----------------------------------------------------------------

def refusal(body: dict[str, Any], kind: type[ChatRequest | CompletionRequest] = ChatRequest) -> GatewayError:
    with pytest.raises(ValidationError) as caught:
        kind.model_validate(body)
    return validation_error(caught.value.errors(), 400)


@pytest.mark.parametrize(("tools", "param", "message", "code"), [
    ([{"type": "function"}], "tools.0.function", "'tools.0.function': Field required",
     "missing_required_parameter"),
    ([{"type": "function", "function": {}}], "tools.0.function.name", "'tools.0.function.name': Field required",
     "missing_required_parameter"),
    ([{"type": "function", "function": {"name": "get weather!"}}], "tools.0.function.name",
     "'tools.0.function.name': String should match pattern '^[a-zA-Z0-9_.-]{1,64}$'", "invalid_value"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools.0.function.name",
     "'tools.0.function.name': String should match pattern '^[a-zA-Z0-9_.-]{1,64}$'", "invalid_value"),
    ([{"type": "function", "function": {"name": 5}}], "tools.0.function.name",
     "'tools.0.function.name': Input should be a valid string", "invalid_type"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "tools.0.type", "'tools.0.type': Input should be "
     "'function'", "invalid_value"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools.0.function.parameters",
     "'tools.0.function.parameters': Input should be a valid dictionary", "invalid_type"),
    ([{"type": "function", "function": {"name": "f", "code": "rm -rf"}}], "tools.0.function.code",
     "unknown field 'tools.0.function.code'", "unknown_parameter"),
    ([{"type": "function", "function": {"name": "f"}}, "search"], "tools.1",
     "'tools.1': Input should be a valid dictionary or instance of Tool", "invalid_type"),
    ({"type": "function"}, "tools", "'tools': Input should be a valid list", "invalid_type"),
])
def test_a_bad_tools_entry_is_a_400_naming_its_dotted_path(tools: object, param: str, message: str,
                                                           code: str) -> None:
    error = refusal({"model": "m", "messages": MESSAGES, "tools": tools})
    assert (error.status, error.type, error.param, error.message, error.code) == (
        400, "invalid_request_error", param, message, code)


def test_a_tool_schema_nested_too_deep_is_refused() -> None:
    parameters: dict[str, Any] = {}
    for _ in range(70):
        parameters = {"properties": parameters}
    error = refusal({"model": "m", "messages": MESSAGES,
                     "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]})
    assert error.param == "tools" and "nested more than 64 levels deep" in error.message


def test_a_good_tool_is_relayed_as_sent() -> None:
    tool = {"type": "function", "function": {"name": "get_weather.v2", "description": "d", "strict": True,
                                             "parameters": {"type": "object", "properties": {}}}}
    body = ChatRequest.model_validate({"model": "m", "messages": MESSAGES, "tools": [tool]})
    assert body.relayed()["tools"] == [tool]
    bare = ChatRequest.model_validate({"model": "m", "messages": MESSAGES, "tools": [{"function": {"name": "f"}}]})
    assert bare.relayed()["tools"] == [{"function": {"name": "f"}}], "what the client left out stays out"


def test_a_union_fields_alternatives_are_told_in_one_line_without_pydantics_type_names() -> None:
    error = refusal({"model": "m", "messages": MESSAGES, "stop": 5})
    assert (error.param, error.message, error.code) == (
        "stop", "'stop': Input should be a valid string; or Input should be a valid list", "invalid_type")
    choice = refusal({"model": "m", "messages": MESSAGES, "tool_choice": "maybe"})
    assert choice.param == "tool_choice" and "literal" not in choice.message
    prompt = refusal({"model": "m", "prompt": [[]]}, CompletionRequest)
    assert prompt.param == "prompt" and prompt.message.endswith("(and 1 more)") and "list[" not in prompt.message


def test_other_refusals_keep_their_shape() -> None:
    assert validation_error([], 400).body()["error"] == {"message": "the body is invalid", "type":
                                                         "invalid_request_error", "param": "body",
                                                         "code": "invalid_value"}
    bad_json = validation_error([{"type": "json_invalid", "loc": ("body", 12), "msg": "JSON decode error",
                                  "ctx": {"error": "Expecting value"}}], 400)
    assert (bad_json.param, bad_json.code, bad_json.message) == (
        "body", "invalid_json", "the body is not valid JSON (Expecting value at character 12)")
    query = validation_error([{"type": "int_parsing", "loc": ("query", "limit"), "msg": "Input should be a "
                               "valid integer"}], 422)
    assert (query.status, query.param, query.code) == (422, "query.limit", "invalid_type")


def test_through_the_gateway_a_bad_tools_entry_is_openai_shaped(client: TestClient) -> None:
    answer = client.post("/v1/chat/completions", headers={"Authorization": "Bearer x"},
                         json={"model": "m", "messages": MESSAGES, "tools": [{"type": "function", "function": {
                             "name": "f", "parameters": {"type": "object"}, "extra": {"deep": [1, 2]}}}]})
    assert answer.status_code == 400
    assert assert_openai_shaped(answer.json()) == {"message": "unknown field 'tools.0.function.extra'",
                                                   "type": "invalid_request_error",
                                                   "param": "tools.0.function.extra", "code": "unknown_parameter"}
