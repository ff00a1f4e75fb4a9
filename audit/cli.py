"""`appliance audit ...`: verify the chain and checkpoints, follow and export records."""

from __future__ import annotations

import csv
import getpass
import itertools
import json
import os
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from rich.console import Console

from appliance import connection as connections
from appliance.artifacts import artifact_store
from appliance.changes import Change, note_target, records_change
from appliance.commands.common import old_spelling
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.login import local_login
from appliance.settings import load_settings
from audit.archive import archive, fetch
from audit.keys import load_public, public_pem, signing_key, verification_key
from audit.reader import OUTCOMES, ObjectFilter, RecordFilter, parse_outcome, read_records
from audit.records import AuditEvent
from audit.times import FORMS, parse_instant
from audit.verify import AuditVerificationError, verify
from audit.window import select, verify_window
from audit.writer import AuditUnavailable, AuditWriter

audit_app = typer.Typer(help="The tamper-evident audit log.", no_args_is_help=True)
out = Console()
FIELDS = ("seq", "time", "request_id", "username", "subject", "client", "key", "source", "action", "resource",
          "target", "model", "outcome", "reason", "status", "prompt_tokens", "completion_tokens", "latency_ms", "error",
          "prev_hash", "hash")


@audit_app.command("verify")
def verify_command(
    public_key: Annotated[Path | None, typer.Option(help="Auditor's copy of the public key (PEM); "
                                                    "default: this host's key.")] = None,
    from_archive: Annotated[bool, typer.Option("--from-archive", help="Verify the copies in the "
                                               "artifact store instead of the host's log.")] = False,
    window: Annotated[Path | None, typer.Option("--window", help="Verify a window written by `audit export "
                                                "--window` instead of the host's log.")] = None,
) -> None:
    """Check every record's hash, the chain, the sequence and every signed checkpoint."""
    home = Home.from_env()
    key = load_public(public_key) if public_key else verification_key(home)
    if window is not None:
        _verify_window(window, key)
        return
    if not from_archive:
        _verify(home.audit, str(home.audit), key)
        return
    store = artifact_store(load_settings(home.settings_file).artifacts, home)
    with tempfile.TemporaryDirectory(prefix="audit-archive-") as copy:
        fetch(store, Path(copy))
        _verify(Path(copy), f"archive {store.location}", key)


def _verify(directory: Path, name: str, key: Ed25519PublicKey) -> None:
    try:
        summary = verify(directory, key)
    except AuditVerificationError as exc:
        raise ApplianceError(f"audit log {name} FAILED verification at {exc.where}: {exc.reason}") from exc
    unsigned = summary.records - summary.last_checkpoint_seq
    out.print(f"audit log OK ({name}): {summary.records} records in {summary.files} files, "
              f"{summary.checkpoints} signed checkpoints (last at seq {summary.last_checkpoint_seq}; "
              f"{unsigned} newer records not yet checkpointed); head {summary.head}")


def _verify_window(path: Path, key: Ed25519PublicKey) -> None:
    try:
        summary = verify_window(path, key)
    except OSError as exc:
        raise ApplianceError(f"cannot read audit window {path}: {exc.strerror or exc}") from exc
    except AuditVerificationError as exc:
        raise ApplianceError(f"audit window {path} FAILED verification at {exc.where}: {exc.reason}") from exc
    out.print(f"audit window OK ({path}): seq {summary.first_seq} to {summary.last_seq}, linked and "
              f"covered by {summary.checkpoints} signed checkpoints (the last at seq {summary.last_seq}); "
              f"head {summary.head}", soft_wrap=True)


@audit_app.command("archive")
@records_change("audit.archive")
def archive_command() -> None:
    """Copy closed log files and their checkpoints to the artifact store now (the gateway also
    does this every audit.archive_interval_s)."""
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    done = archive(home.audit, artifact_store(settings.artifacts, home),
                   retain_days=settings.audit.archive_retention_days,
                   require_lock=settings.audit.archive_require_lock)
    note_target("archive", done.location)
    lock = (f"write-once (Object Lock COMPLIANCE, {settings.audit.archive_retention_days} days)"
            if done.locked else "NOT write-once (the store does not lock copies)")
    copied = ", ".join(Path(key).name for key in done.files) or "nothing new"
    out.print(f"archived to {done.location}: {copied}; checkpoints "
              f"{Path(done.checkpoints).name if done.checkpoints else 'unchanged'}; copies are {lock}",
              soft_wrap=True)  # one line, as a log takes it


@audit_app.command("export-public-key")
def public_key_command() -> None:
    """Print the checkpoint-signing public key (PEM) to give to auditors."""
    typer.echo(public_pem(verification_key(Home.from_env())).decode(), nl=False)


UserOption = Annotated[str | None, typer.Option("--user", help="Only records of this username.")]
ActionOption = Annotated[str | None, typer.Option("--action", help="Only this action, e.g. users.add.")]
OutcomeOption = Annotated[str | None, typer.Option("--outcome", help=f"Only this outcome: {', '.join(OUTCOMES)}.")]
ObjectOption = Annotated[str | None, typer.Option("--object", help="Only records acting on this object: "
                                                  "KIND:NAME (user:alice, adapter:support-bot) or NAME.")]


@audit_app.command("tail")
def tail(
    lines: Annotated[int, typer.Option("-n", min=0, help="How many records.")] = 10,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep printing new records.")] = False,
    user: UserOption = None, action: ActionOption = None, outcome: OutcomeOption = None, target: ObjectOption = None,
) -> None:
    """Print the last matching records (JSON lines), and with -f new ones as they are written."""
    where = _filter(user, action, outcome, target)
    directory = Home.from_env().audit
    seen = _newest_seq(directory)  # first: a record written meanwhile is printed by -f, not lost
    last = (record for record in read_records(directory, where=where, newest_first=True) if record["seq"] <= seen)
    for record in reversed(list(itertools.islice(last, lines))):
        typer.echo(json.dumps(record))
    while follow:
        time.sleep(0.5)
        for record in _written_after(directory, seen):
            seen = record["seq"]
            if where.matches(record):
                typer.echo(json.dumps(record))


@audit_app.command("export")
def export(
    since: Annotated[str | None, typer.Option(help=f"From this time, inclusive: {FORMS}.")] = None,
    until: Annotated[str | None, typer.Option(help="Before this time (the same forms as --since).")] = None,
    user: UserOption = None, action: ActionOption = None, outcome: OutcomeOption = None, target: ObjectOption = None,
    format: Annotated[str, typer.Option(help="jsonl or csv.")] = "jsonl",
    window: Annotated[bool, typer.Option("--window", help="A window `audit verify --window` checks offline: "
                                         "the records as stored, through the first signed checkpoint at or "
                                         "after the last, then the checkpoints (JSON lines).")] = False,
) -> None:
    """Write matching records to stdout as JSON lines or CSV."""
    if format not in ("jsonl", "csv"):
        raise ApplianceError(f"--format must be jsonl or csv, not {format!r}")
    start = parse_instant(since, name="--since") if since is not None else None
    end = parse_instant(until, name="--until") if until is not None else None
    if window:
        if format != "jsonl" or any(option is not None for option in (user, action, outcome, target)):
            raise ApplianceError("--window takes --since and --until only, as JSON lines: a filtered "
                                 "selection has gaps its chain cannot link across")
        _export_window(Home.from_env(), start, end)
        return
    selected = read_records(Home.from_env().audit, since=start, until=end,
                            where=_filter(user, action, outcome, target))
    if format == "jsonl":
        for record in selected:
            typer.echo(json.dumps(record))
        return
    writer = csv.DictWriter(sys.stdout, fieldnames=FIELDS, extrasaction="ignore")
    writer.writeheader()
    for record in selected:
        writer.writerow({**record, "target": _target_text(record.get("target"))})


def _export_window(home: Home, start: datetime | None, end: datetime | None) -> None:
    chosen = select(home.audit, start, end)
    if chosen.records and chosen.cover is None:
        _sign_head(home)  # the newest records are not checkpointed yet: they are now
        chosen = select(home.audit, start, end)
    for line in chosen.lines():
        typer.echo(line, nl=False)


def _sign_head(home: Home) -> None:
    settings = load_settings(home.settings_file)
    try:
        writer = AuditWriter(home.audit, signing_key(home), max_file_bytes=settings.audit.max_file_bytes)
        try:
            writer.checkpoint()
        finally:
            writer.close()
    except (AuditUnavailable, OSError, ValueError, KeyError) as exc:
        raise ApplianceError(f"the window's last records need a signed checkpoint, which could not be "
                             f"written: {exc}", hint=f"run `appliance audit verify` on {home.audit}") from exc


def _target_text(target: dict[str, Any] | None) -> str:
    """A record's object in one CSV cell: KIND:NAME, then @VERSION and [ROLES] when it has them."""
    if not target:
        return ""
    version = f"@{target['version']}" if target.get("version") is not None else ""
    roles = f"[{' '.join(target['roles'])}]" if target.get("roles") else ""
    return f"{target['kind']}:{target['name']}{version}{roles}"


def _filter(user: str | None, action: str | None, outcome: str | None, target: str | None) -> RecordFilter:
    """The filter the options ask for; Invalid naming the option for a value no record can have."""
    return RecordFilter(user=user, action=action,
                        outcome=parse_outcome(outcome, option="--outcome") if outcome is not None else None,
                        target=ObjectFilter.parse(target, option="--object") if target is not None else None)


def _newest_seq(directory: Path) -> int:
    newest = next(read_records(directory, newest_first=True), None)
    return int(newest["seq"]) if newest else 0


def _written_after(directory: Path, seq: int) -> list[dict[str, Any]]:
    """The records after `seq`, oldest first, read back from the log's end only as far as `seq`."""
    newer = itertools.takewhile(lambda record: record["seq"] > seq, read_records(directory, newest_first=True))
    return list(newer)[::-1]


def record_change(home: Home, change: Change) -> None:
    """The `appliance.change_recorders` entry point: a CLI change on this host, as an audit
    record of the local user. If it cannot be written, the command fails and says so."""
    settings = load_settings(home.settings_file)
    home.ensure()  # the signing key lives in its secrets
    uid = f"uid:{os.getuid()}"
    # A person logged in at the CLI is who acted, whichever OS user ran it (often root).
    person = None if change.actor else local_login(connections.local(settings, home), time.time())
    event = AuditEvent(request_id=uuid.uuid4().hex, action=change.action, outcome=change.outcome,
                       status=change.exit_status, subject=person.subject if person else uid,
                       username=change.actor or (person.username if person else _local_user()),
                       client=change.actor or "appliance-cli",
                       source=f"via local CLI as {uid}" if person else "local", resource="cli",
                       target=change.target, detail=change.detail, error=change.error, reason=change.reason)
    try:
        writer = AuditWriter(home.audit, signing_key(home), max_file_bytes=settings.audit.max_file_bytes)
        try:
            writer.append(event)
        finally:
            writer.close()
    except (AuditUnavailable, OSError, ValueError, KeyError) as exc:
        raise ApplianceError(f"{change.action} ran, but its audit record could not be written: {exc}",
                             hint=f"free space, fix permissions or run `appliance audit verify` on "
                                  f"{home.audit}") from exc


def _local_user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return f"uid:{os.getuid()}"


old_spelling(audit_app, "audit public-key", "audit export-public-key", public_key_command)
