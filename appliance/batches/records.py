"""The batch queue's records: a batch's states and the moves between them, and the objects of
OpenAI's Batch API (files, batches, their errors and counts) with who a batch runs for and a request
claimed to run."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from appliance.queue import Lifecycle

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


class BatchState(StrEnum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FAILED = "failed"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


ENDED = (BatchState.FAILED, BatchState.COMPLETED, BatchState.EXPIRED, BatchState.CANCELLED)
MOVES: dict[BatchState, frozenset[BatchState]] = {
    BatchState.VALIDATING: frozenset({BatchState.IN_PROGRESS, BatchState.FAILED, BatchState.CANCELLING}),
    BatchState.IN_PROGRESS: frozenset({BatchState.FINALIZING, BatchState.CANCELLING}),
    BatchState.CANCELLING: frozenset({BatchState.FINALIZING}),
    BatchState.FINALIZING: frozenset({BatchState.COMPLETED, BatchState.EXPIRED, BatchState.CANCELLED}),
    **{state: frozenset() for state in ENDED},
}
BATCH_LIFECYCLE = Lifecycle("batch", MOVES)
# Which timestamp a move sets (OpenAI's field names).
STAMPS = {BatchState.IN_PROGRESS: "in_progress_at", BatchState.FAILED: "failed_at",
          BatchState.FINALIZING: "finalizing_at", BatchState.COMPLETED: "completed_at",
          BatchState.EXPIRED: "expired_at", BatchState.CANCELLING: "cancelling_at",
          BatchState.CANCELLED: "cancelled_at"}


class FileObject(BaseModel):
    """OpenAI's file object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"


class ErrorEntry(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class Errors(BaseModel):
    object: Literal["list"] = "list"
    data: list[ErrorEntry]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class Batch(BaseModel):
    """OpenAI's batch object."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: Errors | None = None
    input_file_id: str
    completion_window: str
    status: BatchState
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None
    # Not in OpenAI's object (its clients ignore a field they do not know): whose batch it is, so
    # that listings of every user's batches can say.
    owner: str | None = Field(None, description="The username of the user who created it.")


class BatchAsk(BaseModel):
    """The body of POST /v1/batches."""

    model_config = {"extra": "forbid"}

    input_file_id: str = Field(max_length=64)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16)


@dataclass(frozen=True)
class Owner:
    """Who a batch runs for: its creator as their token said when they created it."""

    subject: str
    username: str
    roles: frozenset[str]
    key: str | None = None  # the API key it was made with, if one was


@dataclass(frozen=True)
class Claimed:
    """One request of a batch, claimed by a worker to execute."""

    batch_id: str
    line: int
    custom_id: str
    endpoint: str
    body: dict[str, Any]
    attempts: int = 0  # times it was given back after a failure that may pass

    @property
    def ref(self) -> str:
        """What the worker names it by to the gateway (X-Appliance-Batch-Request)."""
        return f"{self.batch_id}:{self.line}"
