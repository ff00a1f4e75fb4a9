"""What the gateway learns about one request as it passes, in one typed record: opened by the
outermost middleware, filled by authentication and the routes, read by the metering and by the
audit middleware to build the request's record (serve.audit_trail). `context_of(request)` is the
one way to it: no other code keeps facts of a request in its ASGI state."""

from __future__ import annotations

import uuid
from dataclasses import FrozenInstanceError, dataclass, field

from starlette.requests import HTTPConnection
from starlette.types import Scope

from appliance.adapters import AdapterRecord
from appliance.api_keys import ApiKey
from appliance.changes import Target
from serve.answer import Answer
from serve.auth import Principal
from serve.compliance import Marks

SCOPE_KEY = "appliance.context"  # the context's place in the ASGI scope, beside Starlette's own keys


@dataclass(slots=True)
class Transcript:
    """What the relay learned about the request, for its audit record. Mutable: the relay and the
    stream it forwards fill it in as the answer passes."""

    model: str | None = None
    prompt: str | None = None
    params: str | None = None  # the relayed body's other fields (sampling, stops, logit bias, n...)
    answer: Answer = field(default_factory=Answer)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    relayed: bool = False  # sent to an engine: always a record of its own
    marks: Marks = field(default_factory=Marks)  # what compliance filtering did: always a record of its own
    ended: bool = False  # a stream's end marker has arrived from the engine
    tier: str | None = None
    replica: str | None = None
    cache_hit_of: int | None = None  # answered from the cache: the original request's record
    batch: str | None = None  # a batch's request: "<batch id>:<line>"
    ttft_s: float | None = None  # a stream's time to its first token

    def end(self) -> None:
        self.ended = True


@dataclass(frozen=True, slots=True)
class CacheCandidate:
    """An answer for the response cache to keep once its record is written (the record's sequence
    number names it): a stream's only if it reached its end, with no error and not too large."""

    key: str
    model: str  # the name the client asked for
    chunks: list[bytes]  # what the client gets; a stream's still arrive after this is noted
    stream: bool
    media_type: str


@dataclass(frozen=True, slots=True)
class AdapterAnswer:
    """An adapter's answer from an engine (a cache hit says nothing of the version), whose figures go
    to the canary analysis once its record is written."""

    adapter: AdapterRecord
    subject: str
    stream: bool  # a stream's latency is left out: its record waits on the client's pace of reading


@dataclass(slots=True, eq=False)
class RequestContext:
    """One request's facts. Only `request_id` is fixed when the context opens (assigning it again
    raises); every other field is mutable because the request fills it as it passes, and stays
    None (the record then leaves it out) for a request refused before it got so far."""

    request_id: str
    principal: Principal | None = None  # who is calling: authentication (serve.deps)
    refused_key: ApiKey | None = None  # an API key found, then refused: the record names it and its owner
    batch: str | None = None  # a request the batch worker sends for a batch: "<batch id>:<line>"
    transcript: Transcript | None = None  # the relay (serve.relay)
    target: Target | None = None  # the object a route acted on, where its path does not say (note_target)
    detail: str | None = None  # what a change did, in words (note_detail): a key's limits old -> new
    cache_candidate: CacheCandidate | None = None  # the relay: an answer to keep once recorded
    adapter_answer: AdapterAnswer | None = None  # the relay: an answer the canary analysis counts once recorded

    def __setattr__(self, name: str, value: object) -> None:
        if name == "request_id" and hasattr(self, "request_id"):
            raise FrozenInstanceError("a request's id is fixed when its context opens")
        object.__setattr__(self, name, value)


def open_context(scope: Scope) -> RequestContext:
    """The request's context: opened, with a new request id, by the first middleware that asks (in
    the gateway the outermost, MeterMiddleware), and the same one for everything after."""
    context: RequestContext | None = scope.get(SCOPE_KEY)
    if context is None:
        context = scope[SCOPE_KEY] = RequestContext(request_id=uuid.uuid4().hex)
    return context


def context_of(request: HTTPConnection) -> RequestContext:
    """The context of the request a handler, a dependency or an exception handler serves."""
    return open_context(request.scope)
