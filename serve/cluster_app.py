"""The head's cluster listener as an app: its routes (serve.cluster_routes), the weight service,
and the controller of pools spanning hosts (serve.cluster_controller), ticking in its lifespan
with the refusal summaries' writes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from appliance.home import Home
from appliance.settings import Settings
from audit.keys import signing_key
from audit.writer import AuditWriter
from serve.cluster_controller import TICK_S, Controller
from serve.cluster_routes import router
from serve.cluster_weights import WeightService
from serve.middleware import BodyLimitMiddleware
from serve.summaries import Summaries, write_due

log = logging.getLogger("appliance.cluster")
MAX_BODY_BYTES = 64 * 1024


def create_app(settings: Settings, home: Home) -> FastAPI:
    audit = settings.audit
    writer = AuditWriter(home.audit, signing_key(home), max_file_bytes=audit.max_file_bytes)
    # Refusals per source and action, over the gateway's refusal interval and source cap.
    refusals = Summaries(audit.refusal_interval_s, audit.refusal_sources, party_field="source",
                         summary_action=None, keep_last_error=True)
    controller = Controller(settings, home, writer.append)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                try:
                    await asyncio.to_thread(controller.tick)
                    await asyncio.to_thread(write_due, writer, refusals)
                except Exception:  # one failed tick (supervisord busy) must not end the controller
                    log.exception("cluster controller tick failed")
                await asyncio.sleep(TICK_S)

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        write_due(writer, refusals, all_now=True)
        writer.close()

    app = FastAPI(title="appliance cluster", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimitMiddleware, limit=MAX_BODY_BYTES)

    @app.exception_handler(Exception)
    async def fail_closed(_: Request, exc: Exception) -> JSONResponse:
        log.error("cluster request failed", exc_info=exc)
        return JSONResponse({"detail": "internal error"}, status_code=500)

    app.include_router(router(settings, home, controller, WeightService(home), writer, refusals))
    return app
