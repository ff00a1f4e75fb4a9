"""A stand-in engine that answers at once, so a benchmark can isolate the gateway's own cost.

It speaks just enough of vLLM's API for the gateway: /health, /v1/models and a fixed chat
completion (streamed or not).
"""

from __future__ import annotations

import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "SmolLM2-135M-Instruct"
COMPLETION = {"id": "stub", "object": "chat.completion", "created": 0, "model": MODEL,
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "OK."},
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}}


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def chat(request: Request) -> Response:
    body = await request.json()
    if not body.get("stream"):
        return JSONResponse(COMPLETION)

    async def events():
        for piece in ("O", "K", "."):
            chunk = {"id": "stub", "object": "chat.completion.chunk", "model": MODEL,
                     "choices": [{"index": 0, "delta": {"content": piece}}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield f"data: {json.dumps({'choices': [], 'usage': COMPLETION['usage']})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


app = Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                        Route("/v1/chat/completions", chat, methods=["POST"])])
