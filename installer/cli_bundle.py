"""`appliance bundle ...`: build a signed air-gapped bundle, check one, or join one carried in parts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from cryptography.hazmat.primitives import serialization
from rich.console import Console

from appliance.engine_build import ENGINES, choose_engine, driver_loaded
from installer.bundle import join, load_or_create_key, load_public_key, split, verification_commands, verify

bundle_app = typer.Typer(help="Air-gapped bundles: build, verify the signature and every file, join split parts.",
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


@bundle_app.command("build")
def build_command(
    out_dir: Annotated[Path, typer.Option("--out", help="The new bundle directory (must not exist).")],
    model: Annotated[Path | None, typer.Option(help="A checkpoint directory to carry instead of the demo model.")
                     ] = None,
    key: Annotated[Path | None, typer.Option(help="The Ed25519 signing key (PEM); generated (0600) if missing. "
                                                  "Default: the state dir's secrets/bundle-signing-key.pem.")] = None,
    part_mib: Annotated[int | None, typer.Option("--part-mib", help="Also write the bundle as a tar cut into "
                                                                    "parts of this many MiB (OUT-parts/).")] = None,
    engine: Annotated[str, typer.Option(help="The target's vLLM build: cuda for GPU hosts, cpu elsewhere; auto: "
                                             "as for this machine (cuda where an NVIDIA driver is loaded).")]
    = "auto",
) -> None:
    """On a connected machine: wheels (appliance, dependencies, the CPU or CUDA vLLM), Keycloak, the
    model and install.sh in one directory with a signed manifest. Built for this machine's platform
    and Python; install.sh refuses a bundle whose engine does not fit the target host."""
    from appliance.home import Home
    from installer.bundle_build import build

    home = Home.from_env().ensure()
    if engine not in ("auto", *ENGINES):
        raise typer.BadParameter(f"{engine!r}: expected auto, cpu or cuda", param_hint="--engine")
    chosen = choose_engine(engine, driver_loaded())
    out.print(f"engine: {chosen}" + (" (auto: for this machine; --engine cuda|cpu for another target)"
                                     if engine == "auto" else ""))
    signing_key = load_or_create_key(key or home.secrets / "bundle-signing-key.pem")
    built = build(out_dir, home, signing_key, engine=chosen, model=model,
                  on_step=lambda step: out.print(f"== {step}"))
    sizes = ", ".join(f"{part} {size / 2**20:,.1f} MiB" for part, size in built.part_bytes.items())
    out.print(f"bundle {built.bundle}: {sizes}; built in {built.seconds:.0f} s", soft_wrap=True)
    out.print(f"signing key fingerprint (compare it out of band on the target): {built.fingerprint}",
              soft_wrap=True)
    public = signing_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    out.print(f"the builder's public key (carry it to the target apart from the bundle, as builder.pub):\n{public}",
              soft_wrap=True, markup=False, highlight=False)
    out.print("On the target, verify the bundle before running anything from it (openssl and coreutils only):",
              soft_wrap=True)
    for command in verification_commands(built.bundle, built.fingerprint):
        out.print(f"  {command}", soft_wrap=True, markup=False, highlight=False)
    if part_mib is not None:
        parts = split(built.bundle, out_dir.with_name(f"{out_dir.name}-parts"), part_mib * 2**20)
        out.print(f"{len(parts)} parts in {parts[0].parent} (join with `appliance bundle join`)")
