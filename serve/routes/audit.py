"""/admin/audit (role `auditor` or `admin`): query the audit log, newest first or oldest first,
and verify its chain and signed checkpoints against this host's key (never one made for the purpose)."""

from __future__ import annotations

import itertools
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from appliance.errors import StateError
from appliance.home import Home
from audit import AuditVerificationError, read_records, verification_key, verify
from serve.deps import requires


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

    @routes.get("/audit", response_model=list[dict[str, Any]], name="audit.query")
    def audit_records(since: str | None = None, until: str | None = None, user: str | None = None,
                      action: str | None = Query(None, description="Exact action, e.g. users.add."),
                      outcome: Literal["allowed", "denied", "error"] | None = None,
                      newest: bool = Query(False, description="The newest `limit` records, newest first."),
                      limit: int = Query(1000, ge=1, le=10_000)) -> list[dict[str, Any]]:
        """Audit records, oldest first (or newest first), filtered by UTC time range [since, until),
        username, action and outcome. Reading stops when the page is full (newest first reads
        the log backwards from its end)."""
        found = (record for record in read_records(home.audit, since=since, until=until, user=user,
                                                   newest_first=newest)
                 if (action is None or record.get("action") == action)
                 and (outcome is None or record.get("outcome") == outcome))
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
