"""The request bodies the gateway relays: OpenAI's fields plus the vLLM sampling and
structured-output fields it supports, typed; any other field is refused (400, naming it).

What an audit record's hashes cover is declared here, next to the fields: the prompt hash every
field that shapes what the engine is prompted with (`PROMPT_FIELDS`), the parameters hash every
other field (sampling, stop strings, logit bias, token lists, `n`, `echo`...), both taken from the
body as relayed, so a request cannot send one request to the engine and have another recorded.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from appliance.choices import prompt_count
from appliance.settings import RoleLimits
from serve.errors import GatewayError

# Refused on purpose, though vLLM knows them: `chat_template` (a caller's own Jinja template),
# `prompt_embeds` (tensors that bypass tokenisation and the prompt hash), `request_id` (ids are
# the gateway's), `priority` (scheduling is the operator's), `vllm_xargs`, `kv_transfer_params`,
# multimodal and `return_*` debugging fields.

T = TypeVar("T")
NonEmpty = Annotated[list[T], Field(min_length=1)]  # an empty list of prompts would reserve nothing
MAX_NESTING = 64  # levels of objects and lists in one field: OpenAI's shapes (tool schemas too) stay far below
BYTES_PER_TOKEN_ESTIMATE = 4  # a prompt's tokens before the engine counts them: text is ~4 bytes/token
TOOL_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"  # what OpenAI accepts as a function's name


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class FunctionDefinition(BaseModel):
    """A function the model may call: OpenAI's fields."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of a chat request's `tools` (vLLM, like OpenAI's chat API, knows functions only)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")
    PROMPT_FIELDS: ClassVar[tuple[str, ...]] = ()

    model: str = Field(min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=256)
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = Field(None, ge=0)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    echo: bool | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)

    @field_validator("*", mode="after")
    @classmethod
    def _not_too_deep(cls, value: Any) -> Any:
        """Screening, hashing and the engine's template each walk the value: a field nested past
        MAX_NESTING levels is refused (the JSON parser alone allows about a thousand)."""
        level: list[tuple[Any, int]] = [(value, 1)]
        while level:
            item, depth = level.pop()
            if isinstance(item, BaseModel):  # a typed entry (a tool) holds untyped JSON too
                item = dict(item)
            if isinstance(item, dict | list):
                if depth > MAX_NESTING:
                    raise ValueError(f"nested more than {MAX_NESTING} levels deep")
                level.extend((inner, depth + 1) for inner in (item.values() if isinstance(item, dict) else item))
        return value

    def relayed(self) -> dict[str, Any]:
        """The body sent to the engine: the fields the client set."""
        return self.model_dump(exclude_unset=True, by_alias=True)

    @classmethod
    def prompt_text(cls, relayed: dict[str, Any]) -> str:
        """What the prompt hash covers: the prompt-shaping fields of the relayed body, as one
        canonical JSON text (sorted keys, compact; any string, lone surrogates included, kept)."""
        shaping = {name: relayed[name] for name in cls.PROMPT_FIELDS if name in relayed}
        return _canonical(shaping)

    @classmethod
    def params_text(cls, relayed: dict[str, Any]) -> str:
        """What the parameters hash covers: every other field of the relayed body (the model or
        adapter version the engine was asked for included), in the same canonical form."""
        return _canonical({name: value for name, value in relayed.items() if name not in cls.PROMPT_FIELDS})

    def prompts(self) -> int:
        """How many prompts the engine is given (a completion's list of prompts: one each)."""
        return 1

    def choices(self) -> int:
        """How many answers the engine will generate: each prompt's `n`."""
        return self.prompts() * self.n

    def logprobs_asked(self) -> dict[str, int]:
        """Each logprobs field set, and how many it asks for."""
        asked = {"prompt_logprobs": self.prompt_logprobs or 0}
        return {name: value for name, value in asked.items() if value}

    def admission(self, limits: RoleLimits | None, context: int, relayed: dict[str, Any],
                  prompt_text: str) -> tuple[int, int]:
        """Check the caller's caps (400 naming the field); return (prompt estimate from
        `prompt_text`, worst-case completion tokens). A missing max_tokens becomes the role's
        default (its cap, at most the model's context) in `relayed`."""
        asked = _completion_tokens(limits, context, relayed)
        if limits is not None:
            if self.choices() > limits.max_n:
                raise _over_choices(self.prompts(), self.n, limits.max_n)
            for name, value in self.logprobs_asked().items():
                if value > limits.max_logprobs:
                    raise _over_cap(name, value, limits.max_logprobs)
        prompt = len(prompt_text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN_ESTIMATE + 1
        return prompt, (asked or context) * self.choices()


class ChatRequest(_Sampling):
    """An OpenAI chat completion request."""

    PROMPT_FIELDS = ("messages", "tools", "tool_choice", "response_format", "structured_outputs",
                     "chat_template_kwargs", "documents", "add_generation_prompt", "continue_final_message",
                     "add_special_tokens", "truncate_prompt_tokens", "reasoning_effort", "parallel_tool_calls")

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    include_reasoning: bool | None = None

    def logprobs_asked(self) -> dict[str, int]:
        return {**super().logprobs_asked(), **({"top_logprobs": self.top_logprobs} if self.top_logprobs else {})}


class CompletionRequest(_Sampling):
    """An OpenAI (legacy) completion request."""

    PROMPT_FIELDS = ("prompt", "response_format", "structured_outputs", "add_special_tokens",
                     "truncate_prompt_tokens")

    prompt: str | NonEmpty[str] | NonEmpty[int] | NonEmpty[NonEmpty[int]]
    logprobs: int | None = Field(None, ge=0)

    def prompts(self) -> int:
        return prompt_count(self.prompt)

    def logprobs_asked(self) -> dict[str, int]:
        return {**super().logprobs_asked(), **({"logprobs": self.logprobs} if self.logprobs else {})}


def _canonical(fields: dict[str, Any]) -> str:
    """One canonical JSON text (sorted keys, compact; any string, lone surrogates included, kept)."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _completion_tokens(limits: RoleLimits | None, context: int, relayed: dict[str, Any]) -> int | None:
    """The completion tokens a request may use: a field asked past the role's cap or the model's
    context is refused (as OpenAI refuses max_tokens past a model's limit, rather than cutting it),
    a request asking none gets the role's cap (at most the context) set in `relayed`; None: the
    caller has no role limits and asked none."""
    cap = min(limits.max_tokens, context) if limits is not None else context
    for name in ("max_tokens", "max_completion_tokens"):
        value = relayed.get(name)
        if value is not None and value > cap:
            raise _over_cap(name, value, cap) if cap < context else _over_context(name, value, context)
    # vLLM prefers max_completion_tokens (chat) over max_tokens.
    asked: int | None = relayed.get("max_completion_tokens") or relayed.get("max_tokens")
    if asked is None and limits is not None:
        relayed["max_tokens"] = asked = cap
    return asked


def _over_choices(prompts: int, n: int, cap: int) -> GatewayError:
    asked = f"{prompts} prompts x n={n} = {prompts * n} choices" if prompts > 1 else f"'n' is {n}"
    return GatewayError(400, f"{asked}; your role allows at most {cap} choices a request", code="over_limit",
                        param="n" if prompts == 1 else "prompt")


def _over_cap(field: str, asked: int, cap: int) -> GatewayError:
    return GatewayError(400, f"'{field}' is {asked}; your role allows at most {cap}", code="over_limit",
                        param=field)


def _over_context(field: str, asked: int, context: int) -> GatewayError:
    return GatewayError(400, f"'{field}' is {asked}; the model's context is {context} tokens (prompt and "
                        "completion together)", code="over_limit", param=field)


class FeedbackRequest(BaseModel):
    """A client's report on an adapter answer it got (POST /v1/feedback): the task's outcome, its
    satisfaction, or both."""

    model_config = ConfigDict(extra="forbid")

    id: StrictStr = Field(min_length=1, max_length=200, description="The answer's `id`, as the client got it.")
    success: StrictBool | None = Field(None, description="Whether the answer did the task.")
    satisfaction: StrictInt | None = Field(None, ge=1, le=5, description="1 (worst) to 5 (best).")

    @model_validator(mode="after")
    def _something(self) -> FeedbackRequest:
        if self.success is None and self.satisfaction is None:
            raise ValueError("give success, satisfaction or both")
        return self
