"""The OpenAI routes the gateway serves itself (the Batch API's are in serve.routes.batches): the
models a caller may use, chat and text completions (relayed, serve.relay), and feedback on an
adapter's answer for its canary analysis."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from appliance.errors import Conflict, NotFound
from serve.audit_trail import note_target
from serve.auth import Principal
from serve.deps import ChatUser
from serve.errors import GatewayError
from serve.lifespan import Gateway
from serve.relay import relay
from serve.schemas import ChatRequest, CompletionRequest, FeedbackRequest


def router() -> APIRouter:
    routes = APIRouter(prefix="/v1", tags=["openai"])

    @routes.get("/models", name="models.list")
    async def list_models(request: Request, who: ChatUser) -> dict[str, Any]:
        """The models the engine pools serve, and the adapters the caller's roles may use."""
        gateway: Gateway = request.app.state.gateway
        with gateway.limiter.admit(who.subject, who.roles):
            return await _models(gateway, who)

    @routes.post("/feedback", name="feedback.create")
    async def feedback(request: Request, who: ChatUser, body: FeedbackRequest) -> dict[str, Any]:
        """Report on an adapter answer you got, by its id (within the hour): whether it did the task
        and how satisfied you were (1 to 5). A canary under analysis compares versions on them."""
        gateway: Gateway = request.app.state.gateway
        with gateway.limiter.admit(who.subject, who.roles):
            try:  # another's answer is as unknown as one never given
                answered, counted = gateway.adapters.canaries.report(body.id, who.subject, body.success,
                                                                     body.satisfaction)
            except NotFound as exc:
                raise GatewayError(404, exc.message, type="not_found_error", code="answer_not_found",
                                   param="id") from None
            except Conflict as exc:
                raise GatewayError(409, exc.message, code="already_reported", param="id") from None
            note_target(request, "adapter", answered.name, version=answered.version)
            outcome = "none" if body.success is None else "success" if body.success else "failure"
            gateway.metrics.adapter_feedback.labels(answered.name, str(answered.version), outcome).inc()
            return {"object": "feedback", "id": body.id, "adapter": answered.name, "version": answered.version,
                    "counted": counted}

    @routes.post("/chat/completions", name="chat.completions")
    async def chat_completions(request: Request, who: ChatUser, body: ChatRequest) -> Response:
        """Chat completion, streamed (SSE) or not, relayed to the pool serving `model`."""
        return await relay(request, who, "/v1/chat/completions", body)

    @routes.post("/completions", name="completions")
    async def text_completions(request: Request, who: ChatUser, body: CompletionRequest) -> Response:
        """Text completion, streamed (SSE) or not, relayed to the pool serving `model`."""
        return await relay(request, who, "/v1/completions", body)

    return routes


async def _models(gateway: Gateway, who: Principal) -> dict[str, Any]:
    # By served name, never a path (serve.upstream.model_entry); clients call adapters by their
    # names (below), not the engines' versions. A model served in tiers is listed once.
    listed = {entry["id"]: entry for entry in await gateway.upstreams.models()}
    data = list(listed.values())
    if data:
        data += gateway.adapters.visible(who.roles)
    if not data:
        raise GatewayError(503, "no engine pool is reachable; retry shortly",
                           type="service_unavailable", code="engine_unavailable",
                           headers={"Retry-After": "5"})
    return {"object": "list", "data": [entry for entry in data if who.may_use(str(entry.get("id")))]}
