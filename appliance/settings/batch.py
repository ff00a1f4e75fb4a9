"""The Batch API's settings: file and queue quotas, and the batch-worker's pace."""

from __future__ import annotations

from pydantic import Field

from appliance.settings.section import Section


class BatchSettings(Section):
    """OpenAI's Batch API: files, the durable queue and the supervised batch-worker executing it."""

    IN_SUPERVISOR_CONFIG = False

    max_file_bytes: int = Field(64 << 20, ge=1024, le=1 << 30, description="Largest file a client may upload "
                                "(the gateway's max_body_bytes does not apply to /v1/files).")
    max_stored_bytes_per_user: int = Field(
        1 << 30, ge=1024, description="Bytes of files (uploads and batch outputs) a user may hold at once.")
    max_requests: int = Field(50_000, ge=1, description="Requests one batch may hold.")
    max_active_per_user: int = Field(8, ge=1, description="Batches validating or in progress a user may have at "
                                     "once.")
    max_failed_validations_per_hour: int = Field(
        10, ge=1, description="Batches a user may have fail validation (or cancel while validating) in an hour; "
        "past it, creating one is a 429 (each validation reads the whole input file).")
    max_validated_bytes_per_hour: int = Field(
        1 << 30, ge=1, description="Bytes of input files a user's batches created in an hour may hold, whatever "
        "became of them (each validation reads its whole file); past it, creating one is a 429.")
    max_pending_requests_per_user: int = Field(
        200_000, ge=1, description="Requests a user may have waiting over all their batches.")
    concurrency: int = Field(2, ge=1, le=256, description="Requests the worker sends at once.")
    max_attempts: int = Field(3, ge=1, le=20, description="Times a request is sent that the gateway answers 500, "
                              "502 or 504 (an engine failing mid-answer) before that answer is its result.")
    yield_to_interactive: int = Field(
        1, ge=0, description="A batch request waits while its pool has this many interactive requests in flight "
        "or more (0: never waits); interactive traffic goes first.")
    max_yield_s: float = Field(120.0, gt=0, description="A batch request waits this long at most, then goes "
                               "(batches never starve).")
    poll_s: float = Field(1.0, gt=0, le=60, description="How often an idle worker looks for work.")
