"""Audit records for tests that write or archive an audit log."""

from __future__ import annotations

from audit import AuditEvent


def event(n: int, **changes: object) -> AuditEvent:
    """The `n`th of a run of allowed chat completions by alice, with `changes` applied."""
    fields = {"request_id": f"r{n}", "action": "chat.completions", "outcome": "allowed", "status": 200,
              "subject": "u1", "username": "alice", "resource": "SmolLM2-135M-Instruct",
              "prompt_tokens": 3, "completion_tokens": 5}
    return AuditEvent.model_validate({**fields, **changes})
