"""Audit records: one canonical JSON line each, chained by SHA-256.

A record's hash is SHA-256 over its canonical bytes (sorted keys, no spaces, UTF-8) with the
`hash` field left out; `prev_hash` holds the previous record's hash (GENESIS for the first).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from appliance.changes import Outcome, Target

GENESIS = "0" * 64


_SURROGATE = re.compile("[\ud800-\udfff]")


def canonical(fields: dict[str, Any]) -> bytes:
    """The bytes that are hashed and signed: sorted keys, compact, UTF-8. A lone surrogate (which
    UTF-8 cannot hold) is written as its JSON escape, which reads back as the same string."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return _SURROGATE.sub(lambda found: f"\\u{ord(found.group()):04x}", text).encode()


def digest(fields: dict[str, Any]) -> str:
    """SHA-256 hex over the canonical bytes of `fields` without their `hash`."""
    return hashlib.sha256(canonical({k: v for k, v in fields.items() if k != "hash"})).hexdigest()


class AuditEvent(BaseModel):
    """What happened, as the caller reports it; the log adds sequence, time and chain."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str
    action: str = Field(description="e.g. chat.completions, auth.denied, users.add")
    outcome: Outcome = Field(description="allowed; denied (no or bad credentials, a missing role, over a limit); "
                             "invalid (the caller's fault: a bad request, no such object); error (the "
                             "appliance's fault). Records before this field had four values said error for "
                             "invalid too.")
    status: int
    subject: str | None = None
    username: str | None = None
    client: str | None = Field(None, description="What called: an API key's name, the token's client (azp), or "
                               "the appliance's own service (batch-worker, finetune-worker, cluster).")
    key: str | None = Field(None, description="The API key the request was made with.")
    source: str | None = None
    resource: str | None = Field(None, description="Where the action was asked: the HTTP path and query "
                                 "(capped), `cli` for a command on the host, `keycloak` for the realm's events.")
    target: Target | None = Field(None, description="The object acted on: kind, name, version, roles.")
    model: str | None = Field(None, description="The model (pool, tier or adapter alias) that was asked.")
    reason: str | None = Field(None, description="A refusal's or failure's reason code (the error's `code`).")
    detail: str | None = Field(None, description="What a change did, in words.")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float | None = None
    prompt_hmac: str | None = None
    completion_hmac: str | None = None
    params_hmac: str | None = Field(None, description="Keyed hash of the request's other fields as relayed "
                                    "(sampling, stop strings, logit bias, token lists, n, echo, max_tokens...): with "
                                    "prompt_hmac it covers everything that shapes the answer.")
    prompt: str | None = Field(None, description="Raw text, only when capture is on.")
    params: str | None = Field(None, description="The request's other fields as canonical JSON, only when "
                               "capture is on.")
    completion: str | None = Field(None, description="Raw text, only when capture is on.")
    tools_called: list[str] | None = Field(None, description="Names of the tools the answer called, in order.")
    tool_arguments_hmac: list[str] | None = Field(
        None, description="Keyed hashes of those calls' arguments, in the same order (equal arguments compare "
        "equal; the arguments stay secret).")
    sensitive: dict[str, str] | None = Field(
        None, description="What live compliance filtering did, by where and kind: {\"prompt.email\": \"flagged\", "
        "\"answer.payment_card\": \"redacted\"}; never the text.")
    tier: str | None = Field(None, description="The tier of its model that served the request, if the pool has one.")
    replica: str | None = Field(None, description="The engine replica that served it.")
    cache_hit_of: int | None = Field(None, description="Answered from the response cache: the sequence number of "
                                     "the record of the request whose answer it was.")
    batch: str | None = Field(None, description="A request of a batch (OpenAI's Batch API): \"<batch id>:<line>\".")
    count: int | None = Field(None, description="A summary record: how many requests it stands for (refused "
                              "ones, or monitoring reads after the first of their interval).")
    error: str | None = Field(None, description="What went wrong on the gateway's side, if anything.")


class AuditRecord(AuditEvent):
    """An event as written: sequence number, UTC time, previous and own hash."""

    seq: int
    time: str
    prev_hash: str
    hash: str

    def line(self) -> bytes:
        """The record as one canonical JSON line."""
        return canonical(self.model_dump()) + b"\n"
