"""/admin/audit (role `auditor` or `admin`): query the audit log, newest first or oldest first,
and verify its chain and signed checkpoints against this host's key (never one made for the purpose)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from appliance.errors import Invalid, StateError
from appliance.home import Home
from audit import AuditVerificationError, read_records, verification_key, verify
from audit.reader import OBJECT_FORMS, OUTCOMES, ObjectFilter, RecordFilter, parse_outcome
from audit.times import FORMS, parse_instant
from serve.audit_trail import REFRESHED
from serve.deps import requires
from serve.errors import GatewayError

Parsed = TypeVar("Parsed")


class ChainCheck(BaseModel):
    """The result of verifying the audit log's chain and signed checkpoints."""

    ok: bool
    records: int = 0
    checkpoints: int = 0
    last_checkpoint_seq: int = 0
    where: str | None = Field(None, description="The first bad record or checkpoint (file:line (seq)).")
    reason: str | None = None



def router(home: Home) -> APIRouter:
    """Query and verify the audit log (role `auditor` or `admin`)."""
    routes = APIRouter(prefix="/admin", tags=["audit"], dependencies=[Depends(requires("auditor", "admin"))])

    @routes.get("/audit", response_model=list[dict[str, Any]], name="audit.query", openapi_extra=REFRESHED)
    def audit_records(since: str | None = Query(None, description=f"From this time, inclusive: {FORMS}."),
                      until: str | None = Query(None, description="Before this time (the same forms as since)."),
                      user: str | None = Query(None, description="Exact username."),
                      action: str | None = Query(None, description="Exact action, e.g. users.add."),
                      outcome: str | None = Query(None, description=f"One of {', '.join(OUTCOMES)}."),
                      target: str | None = Query(None, alias="object",
                                                 description=f"The object acted on: {OBJECT_FORMS}."),
                      newest: bool = Query(False, description="The newest `limit` records, newest first."),
                      limit: int = Query(1000, ge=1, le=10_000)) -> list[dict[str, Any]]:
        """Audit records, oldest first (or newest first), filtered by time range [since, until),
        username, action, outcome and object. Reading stops when the page is full (newest first
        reads the log backwards from its end)."""
        where = RecordFilter(user=user, action=action, outcome=_query(outcome, "outcome", _outcome),
                             target=_query(target, "object", _object))
        found = read_records(home.audit, since=_query(since, "since", _instant),
                             until=_query(until, "until", _instant), where=where, newest_first=newest)
        return list(itertools.islice(found, limit))

    @routes.post("/audit/verify", response_model=ChainCheck, name="audit.verify")
    def verify_chain() -> ChainCheck:
        """Verify every record's hash, the chain, the sequence and every checkpoint's signature."""
        try:
            summary = verify(home.audit, verification_key(home))
        except AuditVerificationError as exc:
            return ChainCheck(ok=False, where=exc.where, reason=exc.reason)
        except StateError as exc:  # no key, or one others can read: nothing to trust the checkpoints with
            return ChainCheck(ok=False, where=str(home.secrets), reason=exc.message)
        return ChainCheck(ok=True, records=summary.records, checkpoints=summary.checkpoints,
                          last_checkpoint_seq=summary.last_checkpoint_seq)

    return routes


def _instant(text: str, name: str) -> datetime:
    return parse_instant(text, name=name)


def _object(text: str, name: str) -> ObjectFilter:
    return ObjectFilter.parse(text, option=name)


def _outcome(text: str, name: str) -> str:
    return parse_outcome(text, option=name)


def _query(value: str | None, param: str, parse: Callable[[str, str], Parsed]) -> Parsed | None:
    """`value` parsed, or None if absent; a 400 naming the query parameter if it cannot be."""
    if value is None:
        return None
    try:
        return parse(value, f"query parameter {param!r}")
    except Invalid as exc:
        raise GatewayError(400, exc.message, code=exc.code, param=param) from exc
