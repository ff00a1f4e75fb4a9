"""`appliance stage`: stage a checkpoint for a plan, or verify a staged directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.progress import byte_progress
from appliance.records import load_plan
from appliance.settings import load_settings
from installer.remote_source import fetch_checkpoint
from installer.staging import stage_sharded, stage_subset, verify_staged

out = Console()


def stage_command(
    source: Annotated[str | None, typer.Argument(help="The checkpoint directory, or s3://BUCKET/PREFIX "
                                                     "on the artifacts S3 server.")] = None,
    plan: Annotated[Path | None, typer.Option(help="Plan file from `appliance plan ... --json`.")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Where host directories are written.")] = None,
    host: Annotated[str | None, typer.Option(help="Stage only this host of the plan.")] = None,
    format: Annotated[str, typer.Option(help="subset (per-host tensors, byte-exact) or sharded "
                                             "(per-rank files for --load-format sharded_state).")] = "subset",
    verify: Annotated[Path | None, typer.Option(help="Check a staged directory against its manifest "
                                                     "and the source, and stop.")] = None,
    workers: Annotated[int, typer.Option(min=1, help="Files copied in parallel.")] = 2,
) -> None:
    """Stage SOURCE for a plan: each host gets only what its ranks load; resumable, verified."""
    if verify is not None:
        checked = verify_staged(verify)
        out.print(f"staged files match their manifests: {', '.join(checked)}")
        return
    if source is None or plan is None or out_dir is None:
        raise ApplianceError("stage needs SOURCE, --plan and --out (or --verify DIR)")
    if format not in ("subset", "sharded"):
        raise ApplianceError(f"--format {format!r}: use subset or sharded")
    record = load_plan(plan, str(plan))
    with byte_progress() as progress:
        model_dir = Path(source)
        if source.startswith("s3://"):
            home = Home.from_env()
            task = progress.add_task("fetching", total=None)
            model_dir = fetch_checkpoint(source, out_dir / ".source", load_settings(home.settings_file).artifacts,
                                         on_bytes=lambda n: progress.advance(task, n),
                                         on_total=lambda n: progress.update(task, total=n))
        task = progress.add_task("staging", total=None)
        callbacks = {"on_bytes": lambda n: progress.advance(task, n),
                     "on_total": lambda n: progress.update(task, total=n)}
        if format == "sharded":
            staged = stage_sharded(model_dir, record, out_dir, host=host, **callbacks)
        else:
            staged = stage_subset(model_dir, record, out_dir, host=host, workers=workers, **callbacks)
    for item in staged:
        resumed = f", {item.resumed} already done" if item.resumed else ""
        out.print(f"{item.host}: {item.files} files, {item.bytes / 2**30:.2f} GiB in {item.directory}{resumed}",
                  soft_wrap=True)
