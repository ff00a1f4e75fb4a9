"""The tamper-evident audit log (issue 4)."""
