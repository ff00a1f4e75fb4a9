"""The relayed request bodies: typed, unknown fields refused, the prompt hash covering
every prompt-shaping field as relayed, and the per-role caps."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from appliance.settings import WHOLE_CONTEXT, GatewaySettings, RoleLimits
from serve.errors import GatewayError
from serve.schemas import ChatRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_a_completion_cannot_carry_messages_to_forge_its_record() -> None:
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"model": "m", "prompt": "sent", "messages": ["recorded"]})
    [error] = caught.value.errors()
    assert error["type"] == "extra_forbidden" and error["loc"] == ("messages",)


@pytest.mark.parametrize("field", ["chat_template", "prompt_embeds", "request_id", "vllm_xargs", "priority"])
def test_fields_that_bypass_the_audit_or_the_operator_are_refused(field: str) -> None:
    with pytest.raises(ValidationError):
        ChatRequest.model_validate({"model": "m", "messages": MESSAGES, field: "x"})


def test_the_prompt_text_covers_every_prompt_shaping_field_as_relayed() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = ChatRequest.model_validate({"model": "m", "messages": MESSAGES, "tools": tools, "temperature": 0.5,
                                       "chat_template_kwargs": {"enable_thinking": False},
                                       "response_format": {"type": "json_object"}})
    relayed = body.relayed()
    shaped = json.loads(body.prompt_text(relayed))
    assert set(shaped) == {"messages", "tools", "chat_template_kwargs", "response_format"}
    assert "temperature" not in shaped, "sampling does not shape the prompt"
    other = ChatRequest.model_validate({**relayed, "tools": []})
    assert other.prompt_text(other.relayed()) != body.prompt_text(relayed)


def test_any_string_is_kept_in_the_prompt_text() -> None:
    body = CompletionRequest.model_validate({"model": "m", "prompt": "a\ud800b\x00"})
    assert json.loads(body.prompt_text(body.relayed()))["prompt"] == "a\ud800b\x00"


LIMITS = RoleLimits(max_tokens=100, max_n=2, max_logprobs=3)


def admit(body: ChatRequest | CompletionRequest, limits: RoleLimits) -> tuple[int, int]:
    relayed = body.relayed()
    return body.admission(limits, 2048, relayed, body.prompt_text(relayed))


@pytest.mark.parametrize(("extra", "field"), [({"max_tokens": 101}, "max_tokens"),
                                              ({"max_completion_tokens": 500}, "max_completion_tokens"),
                                              ({"n": 3}, "n"), ({"top_logprobs": 4, "logprobs": True}, "top_logprobs"),
                                              ({"prompt_logprobs": 9}, "prompt_logprobs")])
def test_role_caps_refuse_with_400_naming_the_field(extra: dict, field: str) -> None:
    body = ChatRequest.model_validate({"model": "m", "messages": MESSAGES, **extra})
    with pytest.raises(GatewayError) as caught:
        admit(body, LIMITS)
    assert caught.value.status == 400 and caught.value.param == field


def test_completion_logprobs_are_capped_too() -> None:
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 5})
    with pytest.raises(GatewayError):
        admit(body, LIMITS)


def test_admission_is_the_worst_case_and_a_missing_max_tokens_gets_the_roles_cap() -> None:
    body = ChatRequest.model_validate({"model": "m", "messages": MESSAGES, "n": 2})
    relayed = body.relayed()
    prompt, completion = body.admission(LIMITS, 2048, relayed, body.prompt_text(relayed))
    assert relayed["max_tokens"] == 100 and completion == 200 and prompt >= 1
    whole = admit(body, RoleLimits(max_tokens=WHOLE_CONTEXT))
    assert whole[1] == 2 * 2048, "a cap past the context: the model's whole context per choice"
    relayed = body.relayed()
    assert body.admission(None, 2048, relayed, body.prompt_text(relayed))[1] == 2 * 2048 and \
        "max_tokens" not in relayed, "no role limits: nothing is set, the engine's own default applies"


def test_the_default_caps_are_4096_for_users_and_the_models_context_for_admins() -> None:
    limits = GatewaySettings().limits
    assert (RoleLimits().max_tokens, limits["user"].max_tokens, limits["admin"].max_tokens) == (4096, 4096,
                                                                                                WHOLE_CONTEXT)


@pytest.mark.parametrize(("cap", "context", "given"), [(4096, 2048, 2048), (100, 2048, 100),
                                                      (WHOLE_CONTEXT, 512, 512)])
def test_a_request_asking_no_max_tokens_gets_the_roles_cap_within_the_context(cap: int, context: int,
                                                                               given: int) -> None:
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    relayed = body.relayed()
    _, completion = body.admission(RoleLimits(max_tokens=cap), context, relayed, body.prompt_text(relayed))
    assert relayed["max_tokens"] == completion == given


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_asking_past_the_roles_cap_is_a_400_naming_the_field_and_the_cap(field: str) -> None:
    body = ChatRequest.model_validate({"model": "m", "messages": MESSAGES, field: 4097})
    relayed = body.relayed()
    with pytest.raises(GatewayError) as caught:
        body.admission(RoleLimits(), 8192, relayed, body.prompt_text(relayed))
    error = caught.value
    assert (error.status, error.param, error.code) == (400, field, "over_limit")
    assert error.message == f"'{field}' is 4097; your role allows at most 4096"
    at_cap = ChatRequest.model_validate({"model": "m", "messages": MESSAGES, field: 4096})
    relayed = at_cap.relayed()
    assert at_cap.admission(RoleLimits(), 8192, relayed, at_cap.prompt_text(relayed))[1] == 4096


@pytest.mark.parametrize("limits", [RoleLimits(max_tokens=WHOLE_CONTEXT), RoleLimits(max_tokens=10_000), None])
def test_asking_past_the_models_context_is_a_400_whatever_the_role(limits: RoleLimits | None) -> None:
    body = ChatRequest.model_validate({"model": "m", "messages": MESSAGES, "max_tokens": 2049})
    relayed = body.relayed()
    with pytest.raises(GatewayError) as caught:
        body.admission(limits, 2048, relayed, body.prompt_text(relayed))
    assert (caught.value.status, caught.value.param) == (400, "max_tokens")
    assert "2049" in caught.value.message and "context is 2048 tokens" in caught.value.message
    at_context = ChatRequest.model_validate({"model": "m", "messages": MESSAGES, "max_tokens": 2048})
    relayed = at_context.relayed()
    assert at_context.admission(limits, 2048, relayed, at_context.prompt_text(relayed))[1] == 2048


@pytest.mark.parametrize(("prompt", "n", "choices"), [("one", 2, 2), (["a", "b"], 1, 2), (["a", "b"], 2, 4),
                                                       ([1, 2, 3], 2, 2), ([[1], [2], [3]], 1, 3)])
def test_each_prompt_of_a_list_counts_as_its_own_choices(prompt: object, n: int, choices: int) -> None:
    body = CompletionRequest.model_validate({"model": "m", "prompt": prompt, "n": n, "max_tokens": 10})
    assert body.choices() == choices
    assert admit(body, RoleLimits(max_n=4))[1] == 10 * choices, "the reservation is per choice"


def test_a_list_of_prompts_cannot_pass_max_n() -> None:
    body = CompletionRequest.model_validate({"model": "m", "prompt": ["p"] * 16, "n": 4, "max_tokens": 1})
    with pytest.raises(GatewayError) as caught:
        admit(body, RoleLimits(max_n=4))
    assert caught.value.status == 400 and caught.value.param == "prompt"
    assert "16 prompts x n=4 = 64 choices" in caught.value.message


@pytest.mark.parametrize("prompt", [[], [[]], [[1], []]])
def test_an_empty_list_of_prompts_is_refused(prompt: object) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})


@pytest.mark.parametrize("change", [{"logit_bias": {"50": 100}}, {"allowed_token_ids": [1, 2]},
                                    {"bad_words": ["no"]}, {"stop": ["."]}, {"min_tokens": 5}, {"n": 2},
                                    {"echo": True}, {"max_tokens": 7}, {"seed": 1}, {"temperature": 1.5}])
def test_the_parameters_text_covers_every_field_that_changes_the_answer(change: dict) -> None:
    base = CompletionRequest.model_validate({"model": "m", "prompt": "same"})
    other = CompletionRequest.model_validate({"model": "m", "prompt": "same", **change})
    assert base.prompt_text(base.relayed()) == other.prompt_text(other.relayed())
    assert base.params_text(base.relayed()) != other.params_text(other.relayed())


@pytest.mark.parametrize("kind", [ChatRequest, CompletionRequest])
def test_prompt_and_parameters_texts_together_hold_the_whole_relayed_body(kind: type) -> None:
    every = {name for name in kind.model_fields} - {"messages", "prompt"}
    body = kind.model_validate({"model": "m", ("messages" if kind is ChatRequest else "prompt"):
                                MESSAGES if kind is ChatRequest else "x"})
    relayed = {**body.relayed(), **dict.fromkeys(every, 1)}
    covered = {**json.loads(body.prompt_text(relayed)), **json.loads(body.params_text(relayed))}
    assert covered.keys() == relayed.keys()
