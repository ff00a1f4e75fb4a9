"""The `batch-worker` program (supervised): validates the input files of new batches, one at a
time in a thread of its own (streamed from the artifact store, line by line, off the gateway),
executes the requests of batches in progress (appliance.batches) through the gateway on loopback,
`batch.concurrency` at a time, and writes each batch's output and error files when its requests
are done.

Each request goes to the gateway as its batch's owner (the worker's key and the request's
reference, serve.deps.batch_principal): it is routed to the model's default tier, screened,
limited by the owner's budgets and audited like any other, and yields to interactive traffic. A
429 or 503 (its owner's budget spent, its engine restarting) gives the request back to the queue
for a while, the others go on, and so does an engine failing mid-answer (500, 502, 504, or 503
`engine_dropped`) until `batch.max_attempts`: a request that kills engines is not sent for ever. The
gateway down, or refusing the worker's key, makes every request wait; any other answer is the
request's result. The gateway checks the owner before each request (serve.deps: the roles they hold
now, their key still valid); a refusal saying they can no longer run it (OWNER_REFUSALS) fails the
batch's remaining requests at once with that answer. Killed, the worker leaves its
claims to the next one (at least once), and a validation it was making starts over; each
batch's end (a failed validation too) is an audit record of its own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from appliance import batches
from appliance.artifacts import ArtifactStore, artifact_store
from appliance.batches import BATCH_HEADER, BATCH_WORKER_SECRET
from appliance.changes import Change, Target, announce
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.local_gateway import client_options
from appliance.secrets import secret
from appliance.settings import Settings
from appliance.supervisor import runs_module
from appliance.work_queues import serve_worker
from serve.limits import RateLimiter

log = logging.getLogger("appliance.batch-worker")
MODULE = "serve.batch_worker"
GATEWAY_DOWN_WAIT_S = 5.0
MAX_RETRY_S = 60.0
FAILED_RETRY_S = 5.0
STORE_DOWN_WAIT_S = 10.0  # the artifact store or the queue failed a validation: it starts over after this
# The gateway's codes (403) for an owner who can no longer run their batch: a role lost, disabled or
# gone, the key it was made with revoked or expired.
OWNER_REFUSALS = frozenset({"missing_role", "inactive", "revoked_key", "expired_key"})


def worker_alive(pid: int | None) -> bool:
    return runs_module(pid, MODULE)


class Worker:
    def __init__(self, settings: Settings, home: Home) -> None:
        self.settings = settings
        self.home = home
        self.store: ArtifactStore = artifact_store(settings.artifacts, home)
        # Generation takes long, but not for ever: an answer that has not come in half the watchdog's
        # stall limit for batch work is given back as a failure that may pass (never a stuck worker).
        self.http = httpx.Client(**client_options(settings, home),
                                 timeout=httpx.Timeout(None, connect=5.0, read=settings.watchdog.batch_stall_s / 2),
                                 headers={"Authorization": f"Bearer {secret(home, BATCH_WORKER_SECRET)}",
                                          "Content-Type": "application/json"})
        self.gateway_down_until = 0.0
        self.lock = threading.Lock()
        self.caps = RateLimiter(settings.gateway.limits)  # its limits_for: the caps the gateway applies

    def validate_next(self) -> bool:
        """Validate the next batch waiting for it, if any (False: none). Whatever goes wrong with
        one file, the worker goes on: the store or the queue down, the batch waits and starts over;
        a fault of the worker's own fails the batch, saying so."""
        job = batches.claim_validation(self.home, os.getpid(), worker_alive)
        if job is None:
            return False
        try:
            self._validate(job)
        except ApplianceError as exc:
            log.error("batch %s validation left to start over: %s", job.batch_id, exc.one_line())
            time.sleep(STORE_DOWN_WAIT_S)
        except Exception as exc:  # a file the worker cannot read must not be retried for ever
            log.exception("batch %s validation failed in the worker", job.batch_id)
            batches.fail_validation(self.home, job, "server_error",
                                    f"the batch worker could not validate this file ({type(exc).__name__})")
        return True

    def _validate(self, job: batches.Validating) -> None:
        started = time.monotonic()
        caps = self.caps.limits_for(job.owner.roles)
        batch = batches.validate(self.home, self.store, job, self.settings.batch, self.settings.gateway.max_body_bytes,
                                 caps.max_n if caps is not None else None)
        log.info("batch %s validated in %.1f s: %s, %d requests, %d errors", batch.id, time.monotonic() - started,
                 batch.status, batch.request_counts.total, len(batch.errors.data) if batch.errors else 0)

    def validate_forever(self) -> None:
        while True:
            try:
                found = self.validate_next()
            except ApplianceError as exc:  # the queue itself: this thread must outlive it
                log.error("batch validation: %s", exc.one_line())
                found = False
            if not found:
                time.sleep(self.settings.batch.poll_s)

    def execute(self, request: batches.Claimed) -> None:
        """Send one request; record its answer, or give it back to the queue to retry later.
        Whatever goes wrong with one request, the others go on."""
        try:
            self._execute(request)
        except ApplianceError as exc:  # the queue or the store: the claim stays, the next claim frees it
            log.error("batch request %s left to retry: %s", request.ref, exc.one_line())
        except Exception as exc:  # one request's fault must not stop every batch
            log.exception("batch request %s failed in the worker", request.ref)
            batches.finish(self.home, request, 500, None, {"error": {
                "message": f"the batch worker could not run this request ({type(exc).__name__})",
                "type": "server_error"}})

    def _execute(self, request: batches.Claimed) -> None:
        try:
            response = self.http.post(request.endpoint, content=batches.wire_body(request.body),
                                      headers={BATCH_HEADER: request.ref})
        except httpx.ReadTimeout:  # no answer in time: retried later, a bounded number of times
            if request.attempts + 1 < self.settings.batch.max_attempts:
                batches.release(self.home, request, FAILED_RETRY_S * (request.attempts + 1), failed=True)
            else:
                batches.finish(self.home, request, 504, None, {"error": {
                    "message": f"no answer within {self.settings.watchdog.batch_stall_s / 2:g} s, "
                               f"{request.attempts + 1} times", "type": "server_error",
                    "code": "batch_request_timeout"}})
            return
        except httpx.TransportError as exc:  # the gateway is down: every request waits
            self._all_wait(request, f"gateway not reachable ({type(exc).__name__})")
            return
        if response.status_code == 401:  # the gateway does not take the worker's key (a new one?): all wait
            self._all_wait(request, "the gateway refused the worker's key")
            return
        dropped = response.status_code == 503 and _code(response) == "engine_dropped"
        if (response.status_code in (500, 502, 504) or dropped) and \
                request.attempts + 1 < self.settings.batch.max_attempts:  # an engine failed mid-answer
            batches.release(self.home, request, FAILED_RETRY_S * (request.attempts + 1), failed=True)
            return
        if response.status_code in (429, 503) and not dropped:  # its owner's budget, or its engine: it waits
            try:
                wait = min(max(float(response.headers.get("retry-after", "5")), 1.0), MAX_RETRY_S)
            except ValueError:
                wait = 5.0
            batches.release(self.home, request, wait)
            return
        try:
            answer: object = response.json()
        except ValueError:
            answer = {"error": {"message": response.text[:2000], "type": "server_error"}}
        batches.finish(self.home, request, response.status_code, response.headers.get("x-request-id"), answer)
        if response.status_code == 403 and _code(response) in OWNER_REFUSALS:
            failed = batches.fail_remaining(self.home, request.batch_id, response.status_code, answer)
            log.info("batch %s: its owner can no longer run it (%s): %d requests failed", request.batch_id,
                     _code(response), failed + 1)

    def _all_wait(self, request: batches.Claimed, why: str) -> None:
        with self.lock:
            self.gateway_down_until = time.monotonic() + GATEWAY_DOWN_WAIT_S
        batches.release(self.home, request, GATEWAY_DOWN_WAIT_S)
        log.info("batch request %s back in the queue: %s", request.ref, why)

    def finalize_ready(self) -> None:
        for batch_id in batches.to_finalize(self.home):
            try:
                batches.finalize(self.home, self.store, batch_id)
            except ApplianceError as exc:  # the store is down: the batch stays to be finalized next time
                log.error("batch %s not finalized: %s", batch_id, exc.one_line())
        for batch in batches.to_announce(self.home):  # each end once in the audit log, after a crash too
            detail = _ending(batch)
            try:
                announce(Change(f"batches.{batch.status}", "allowed", 0, Target(kind="batch", name=batch.id),
                                detail, actor="batch-worker"))
            except ApplianceError as exc:
                log.error("batch %s end not recorded in the audit log yet: %s", batch.id, exc.one_line())
                return
            batches.announced(self.home, batch.id)
            log.info(detail)

    def run(self) -> None:
        concurrency = self.settings.batch.concurrency
        # Validating a big file takes seconds: the requests of batches in progress go on meanwhile.
        threading.Thread(target=self.validate_forever, name="batch-validate", daemon=True).start()
        with ThreadPoolExecutor(concurrency, thread_name_prefix="batch") as pool:
            while True:
                self.finalize_ready()
                wait = self.gateway_down_until - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                    continue
                claimed = batches.claim(self.home, os.getpid(), worker_alive, concurrency)
                if not claimed:
                    time.sleep(self.settings.batch.poll_s)
                    continue
                for future in [pool.submit(self.execute, request) for request in claimed]:
                    future.result()


def _ending(batch: batches.Batch) -> str:
    """A batch's end, for the audit log: its counts, or a failed validation's first error."""
    if batch.status == batches.BatchState.FAILED and batch.errors and batch.errors.data:
        first = batch.errors.data[0]
        where = f"line {first.line}" if first.line is not None else "the file"
        field = f", {first.param}" if first.param else ""
        return f"batch {batch.id} failed validation ({len(batch.errors.data)} errors; first at {where}{field}: " \
               f"{first.code}: {first.message})"
    counts = batch.request_counts
    return f"batch {batch.id} {batch.status}: {counts.completed} of {counts.total} requests completed, " \
           f"{counts.failed} failed"


def _code(response: httpx.Response) -> str | None:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def main() -> None:
    serve_worker("batch-worker", lambda home, settings: Worker(settings, home).run())


if __name__ == "__main__":
    main()
