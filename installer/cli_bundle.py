"""`appliance bundle ...`: check a signed air-gapped bundle (or join one carried in parts)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from installer.bundle import join, load_public_key, verify

bundle_app = typer.Typer(help="Air-gapped bundles: verify the signature and every file, join split parts.",
                         no_args_is_help=True)
out = Console()


@bundle_app.command("verify")
def verify_command(
    bundle: Annotated[Path, typer.Argument(help="The bundle directory.")],
    key: Annotated[Path | None, typer.Option(help="The trusted public key (PEM). Without it the bundled key is "
                                                  "used: compare its fingerprint with the builder's.")] = None,
) -> None:
    """Check the manifest's signature, then every file's size and SHA-256; nothing missing or extra."""
    checked = verify(bundle, load_public_key(key) if key else None)
    trust = "the trusted key" if key else "the bundled key (compare this fingerprint with the builder's)"
    out.print(f"{bundle}: {checked.files} files, {checked.bytes:,} bytes, all as signed by {trust}: "
              f"{checked.fingerprint}", soft_wrap=True)


@bundle_app.command("join")
def join_command(
    parts: Annotated[Path, typer.Argument(help="The directory holding the parts and parts.sha256.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Where the bundle directory is unpacked.")],
) -> None:
    """Check every part against its list, join and unpack them (then run `bundle verify`)."""
    out.print(f"bundle unpacked: {join(parts, out_dir)}")


def register(app: typer.Typer) -> None:
    """The `appliance.commands` entry point."""
    app.add_typer(bundle_app, name="bundle")
