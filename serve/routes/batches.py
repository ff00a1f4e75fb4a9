"""OpenAI's Batch API: /v1/files and /v1/batches for their owners (roles `user` or
`admin`), /admin/batches for the administrator. The rules are the core's (appliance.batches);
these routes only translate. A file or batch of another user is a 404, as one that does not exist.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Literal, TypeVar

import anyio
from fastapi import APIRouter, Depends, Form, Query, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel

from appliance import batches
from appliance.artifacts import artifact_store
from appliance.batches import Batch, BatchAsk, FileObject, Owner
from appliance.errors import ArtifactStoreError, StateError
from appliance.home import Home
from appliance.settings import Settings
from serve.audit_trail import MONITORING, note_target
from serve.auth import Principal
from serve.deps import ChatUser, requires
from serve.errors import GatewayError

log = logging.getLogger("appliance.gateway")


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


def _batch_list(found: list[Batch], limit: int) -> BatchList:
    page = found[:limit]
    return BatchList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                     has_more=len(found) > limit)


async def admitted(request: Request, who: ChatUser) -> AsyncIterator[Principal]:
    """The caller, admitted by their role's request rate and concurrency limits, as every /v1 call is."""
    with request.app.state.gateway.limiter.admit(who.subject, who.roles):
        yield who


BatchUser = Annotated[Principal, Depends(admitted)]
T = TypeVar("T")


async def _in_thread(call: Callable[[], T]) -> T:
    """`call` in a worker thread; the store's or the queue's own faults (paths, OS errors, the S3
    endpoint) go to the gateway's log, the client gets a plain 503."""
    try:
        return await anyio.to_thread.run_sync(call)
    except (ArtifactStoreError, StateError) as exc:
        log.error("batch API: %s", exc.one_line())
        raise GatewayError(503, "batch storage is unavailable; retry shortly", type="service_unavailable",
                           code="storage_unavailable", headers={"Retry-After": "30"}) from exc


def router(settings: Settings, home: Home) -> APIRouter:
    routes = APIRouter(tags=["openai"])
    store = artifact_store(settings.artifacts, home)
    limits = settings.batch

    @routes.post("/v1/files", response_model=FileObject, name="files.create")
    async def upload(who: BatchUser, file: UploadFile, purpose: Annotated[str, Form(max_length=64)]) -> FileObject:
        """Upload a JSONL input file for a batch (purpose `batch`), up to batch.max_file_bytes."""
        # The caller was authenticated before the body was read, and the body was refused as soon
        # as it outgrew the limit; the framework spooled the file (memory, then a temporary file),
        # and it goes on to the store from there in pieces.
        if file.size is None or file.size > limits.max_file_bytes:
            raise GatewayError(413, f"the file is larger than {limits.max_file_bytes} bytes "
                               "(batch.max_file_bytes)", code="file_too_large")
        return await _in_thread(lambda: batches.add_file(
            home, store, owner=who.subject, filename=file.filename or "upload.jsonl", purpose=purpose,
            data=file.file, limits=limits))

    @routes.get("/v1/files", response_model=FileList, name="files.list")
    async def files(who: BatchUser) -> FileList:
        """Your files: batch inputs and the outputs of your batches."""
        return FileList(data=await _in_thread(lambda: batches.list_files(home, who.subject)))

    @routes.get("/v1/files/{file_id}", response_model=FileObject, name="files.read")
    async def file_info(who: BatchUser, file_id: str) -> FileObject:
        """One of your files."""
        return (await _in_thread(lambda: batches.get_file(home, file_id, who.subject)))[0]

    @routes.delete("/v1/files/{file_id}", response_model=FileDeleted, name="files.delete")
    async def delete_file(who: BatchUser, file_id: str) -> FileDeleted:
        """Delete one of your files and its bytes."""
        await _in_thread(lambda: batches.delete_file(home, store, file_id, who.subject))
        return FileDeleted(id=file_id)

    @routes.get("/v1/files/{file_id}/content", name="files.content", response_class=Response)
    async def file_content(who: BatchUser, file_id: str) -> Response:
        """The bytes of one of your files (a batch's output: JSONL, one line per request)."""
        _, key = await _in_thread(lambda: batches.get_file(home, file_id, who.subject))
        return Response(await _in_thread(lambda: store.get(key)), media_type="application/jsonl")

    @routes.post("/v1/batches", response_model=Batch, name="batches.create")
    async def create(request: Request, who: BatchUser, ask: BatchAsk) -> Batch:
        """Queue a batch of the requests of an input file, `validating` at once: the batch-worker
        reads the file, then the batch is `in_progress`, or `failed` naming each bad line
        (`errors`). Too many batches, failed validations or requests waiting is a 429."""
        owner = Owner(who.subject, who.username, who.roles, who.key)  # a key's limits hold for its requests too
        made = await _in_thread(lambda: batches.create(home, ask, owner, limits))
        note_target(request, "batch", made.id)
        return made

    @routes.get("/v1/batches", response_model=BatchList, name="batches.list")
    async def listing(who: BatchUser, after: Annotated[str | None, Query(max_length=64)] = None,
                      limit: Annotated[int, Query(ge=1, le=100)] = 20) -> BatchList:
        """Your batches, newest first."""
        found = await _in_thread(lambda: batches.listing(home, who.subject, after=after, limit=limit + 1))
        return _batch_list(found, limit)

    @routes.get("/v1/batches/{batch_id}", response_model=Batch, name="batches.read")
    async def retrieve(who: BatchUser, batch_id: str) -> Batch:
        """One of your batches: its state, request counts and files."""
        return await _in_thread(lambda: batches.get(home, batch_id, who.subject))

    @routes.post("/v1/batches/{batch_id}/cancel", response_model=Batch, name="batches.cancel")
    async def cancel(who: BatchUser, batch_id: str) -> Batch:
        """Stop one of your batches (validating or in progress): requests running finish, no other
        starts; it ends `cancelled` with the answers it has."""
        return await _in_thread(lambda: batches.cancel(home, batch_id, who.subject))

    admin = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])

    @admin.get("/batches", response_model=BatchList, name="batches.admin.list", openapi_extra=MONITORING)
    async def all_batches(after: Annotated[str | None, Query(max_length=64)] = None,
                          limit: Annotated[int, Query(ge=1, le=100)] = 20) -> BatchList:
        """Every user's batches, newest first."""
        found = await _in_thread(lambda: batches.listing(home, None, after=after, limit=limit + 1))
        return _batch_list(found, limit)

    @admin.post("/batches/{batch_id}/cancel", response_model=Batch, name="batches.admin.cancel")
    async def cancel_any(batch_id: str) -> Batch:
        """Stop anyone's batch."""
        return await _in_thread(lambda: batches.cancel(home, batch_id, None))

    routes.include_router(admin)
    return routes

