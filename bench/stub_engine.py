"""A stand-in engine that answers at once (or after a set delay), to isolate the gateway's own cost.

It speaks just enough of vLLM's API for the gateway: /health, /v1/models and a fixed chat
completion (streamed or not), after STUB_ENGINE_DELAY_S seconds (default 0) of "thinking".
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

DELAY_S = float(os.environ.get("STUB_ENGINE_DELAY_S", "0"))
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
    if DELAY_S:
        await asyncio.sleep(DELAY_S)
    if not body.get("stream"):
        return JSONResponse(COMPLETION)

    async def events() -> AsyncIterator[bytes]:
        for piece in ("O", "K", "."):
            chunk = {"id": "stub", "object": "chat.completion.chunk", "model": MODEL,
                     "choices": [{"index": 0, "delta": {"content": piece}}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield f"data: {json.dumps({'choices': [], 'usage': COMPLETION['usage']})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


app = Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                        Route("/v1/chat/completions", chat, methods=["POST"])])
