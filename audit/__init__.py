"""The tamper-evident audit log: hash-chained records, group-committed, signed checkpoints."""

from audit.archive import Archived, archive, fetch
from audit.keys import TextHasher, load_public, public_pem, signing_key, verification_key
from audit.reader import read_records
from audit.records import AuditEvent, AuditRecord
from audit.verify import AuditVerificationError, Verified, verify
from audit.writer import AuditUnavailable, AuditWriter

__all__ = ["Archived", "AuditEvent", "AuditRecord", "AuditUnavailable", "AuditVerificationError", "AuditWriter",
           "TextHasher", "Verified", "archive", "fetch", "load_public", "public_pem", "read_records", "signing_key",
           "verification_key", "verify"]
