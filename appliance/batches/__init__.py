"""The batch queue behind OpenAI's Batch API: files in the artifact store, batches and
their requests in one SQLite database in the state dir, shared by the gateway (which takes files,
creates, lists and cancels batches) and the supervised `batch-worker` (which validates their input
files and executes them through the gateway, so each request is routed, filtered, limited and
audited as any other).

A batch's life, as OpenAI's (every move checked against MOVES, its Lifecycle, inside the transaction
making it):

    validating --> in_progress --> finalizing --> completed | expired
       |    |           |                ^
       v    +------> cancel              |
     failed             v                |
                   cancelling -----------+--> cancelled

Creating a batch only checks what is cheap (the file, the quotas); the worker reads the input file
as a stream, checks it line by line and copies its requests into the queue, a chunk per
transaction, before the batch is in progress (or failed, naming each bad line).

Its requests are a table of the appliance's work queue (appliance.queue): pending, claimed by a
worker (its pid), or done with the engine's answer. A worker that dies leaves its claims to the
next one, so a request may run twice (at least once); the output file holds one line per request
all the same, in the input file's order.

- records: the states, their moves, and the API's objects
- store: the database, its schema and migrations, the two work queues in it
- files: uploads, within their owner's quota
- lifecycle: a batch created (cheap checks only), read, listed, cancelled
- lines and validation: an input file read, checked line by line and copied into the queue
- requests: the worker's claims, retries and answers
- output: a batch's output and error files, its end, and its end announced
"""

from appliance.batches.files import add_file, delete_file, get_file, list_files
from appliance.batches.lifecycle import cancel, cancel_all_of, create, get, listing, owner_of
from appliance.batches.lines import wire_body
from appliance.batches.output import announced, finalize, to_announce, to_finalize
from appliance.batches.records import ENDPOINTS, Batch, BatchAsk, BatchState, Claimed, FileObject, Owner
from appliance.batches.requests import (
    BATCH_HEADER,
    BATCH_WORKER_SECRET,
    claim,
    fail_remaining,
    finish,
    is_claimed,
    release,
)
from appliance.batches.store import MAX_REQUEST_CLAIMS, MAX_VALIDATION_ATTEMPTS, REQUESTS, VALIDATIONS, connect
from appliance.batches.validation import Validating, claim_validation, fail_validation, validate

# What the other packages import from here; the modules hold the rest.
__all__ = [
    "BATCH_HEADER",
    "BATCH_WORKER_SECRET",
    "ENDPOINTS",
    "MAX_REQUEST_CLAIMS",
    "MAX_VALIDATION_ATTEMPTS",
    "REQUESTS",
    "VALIDATIONS",
    "Batch",
    "BatchAsk",
    "BatchState",
    "Claimed",
    "FileObject",
    "Owner",
    "Validating",
    "add_file",
    "announced",
    "cancel",
    "cancel_all_of",
    "claim",
    "claim_validation",
    "connect",
    "create",
    "delete_file",
    "fail_remaining",
    "fail_validation",
    "finalize",
    "finish",
    "get",
    "get_file",
    "is_claimed",
    "list_files",
    "listing",
    "owner_of",
    "release",
    "to_announce",
    "to_finalize",
    "validate",
    "wire_body",
]
