"""`appliance audit ...`: verify the chain and checkpoints, follow and export records."""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from appliance.errors import ApplianceError
from appliance.home import Home
from audit.keys import load_public, public_pem, signing_key
from audit.verify import AuditVerificationError, verify
from audit.reader import read_records

audit_app = typer.Typer(help="The tamper-evident audit log.", no_args_is_help=True)
out = Console()
FIELDS = ("seq", "time", "request_id", "username", "subject", "client", "source", "action", "resource",
          "outcome", "status", "prompt_tokens", "completion_tokens", "latency_ms")


@audit_app.command("verify")
def verify_command(
    public_key: Annotated[Path | None, typer.Option(help="Auditor's copy of the public key (PEM); "
                                                    "default: this host's key.")] = None,
) -> None:
    """Check every record's hash, the chain, the sequence and every signed checkpoint."""
    home = Home.from_env()
    key = load_public(public_key) if public_key else signing_key(home).public_key()
    try:
        summary = verify(home.audit, key)
    except AuditVerificationError as exc:
        raise ApplianceError(f"audit log {home.audit} FAILED verification at {exc.where}: {exc.reason}") from exc
    unsigned = summary.records - summary.last_checkpoint_seq
    out.print(f"audit log OK: {summary.records} records in {summary.files} files, {summary.checkpoints} "
              f"signed checkpoints (last at seq {summary.last_checkpoint_seq}; {unsigned} newer "
              f"records not yet checkpointed); head {summary.head}")


@audit_app.command("public-key")
def public_key_command() -> None:
    """Print the checkpoint-signing public key (PEM) to give to auditors."""
    typer.echo(public_pem(signing_key(Home.from_env())).decode(), nl=False)


@audit_app.command("tail")
def tail(
    lines: Annotated[int, typer.Option("-n", help="How many records.")] = 10,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep printing new records.")] = False,
) -> None:
    """Print the last records (JSON lines), and with -f new ones as they are written."""
    directory = Home.from_env().audit
    last = list(read_records(directory))[-lines:] if lines else []
    for record in last:
        typer.echo(json.dumps(record))
    seen = last[-1]["seq"] if last else 0
    while follow:
        time.sleep(0.5)
        for record in read_records(directory):
            if record["seq"] > seen:
                typer.echo(json.dumps(record))
                seen = record["seq"]


@audit_app.command("export")
def export(
    since: Annotated[str | None, typer.Option(help="From this UTC time (ISO 8601), inclusive.")] = None,
    until: Annotated[str | None, typer.Option(help="Before this UTC time (ISO 8601).")] = None,
    user: Annotated[str | None, typer.Option(help="Only this username.")] = None,
    format: Annotated[str, typer.Option(help="jsonl or csv.")] = "jsonl",
) -> None:
    """Write matching records to stdout as JSON lines or CSV."""
    if format not in ("jsonl", "csv"):
        raise ApplianceError(f"--format must be jsonl or csv, not {format!r}")
    selected = read_records(Home.from_env().audit, since=since, until=until, user=user)
    if format == "jsonl":
        for record in selected:
            typer.echo(json.dumps(record))
        return
    writer = csv.DictWriter(sys.stdout, fieldnames=FIELDS, extrasaction="ignore")
    writer.writeheader()
    for record in selected:
        writer.writerow(record)


def register(app: typer.Typer) -> None:
    """The `appliance.commands` entry point."""
    app.add_typer(audit_app, name="audit")
