"""The `appliance` command: the root that composes every command group.

The core's groups live in appliance.commands, one module each (CORE_COMMANDS); the packages built on
the core add theirs through the `appliance.commands` entry points, so the core imports none of them.
The root lists every command from SUMMARIES and imports a command's module only when that command
runs: `appliance --help` and `appliance status` answer at once instead of importing everything.
"""

from __future__ import annotations

import functools
import importlib
import os
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from appliance.errors import ApplianceError
from appliance.help_style import plain_help
from appliance.home import PRIVATE_UMASK, Home

if TYPE_CHECKING:
    from typer import _click  # the Click that Typer vendors: the types its groups are written in

COMMANDS_GROUP = "appliance.commands"

# The core's own commands: name -> "module:attribute", a Typer app or a command function.
CORE_COMMANDS = {
    "up": "appliance.commands.lifecycle:up",
    "down": "appliance.commands.lifecycle:down",
    "status": "appliance.commands.lifecycle:status",
    "settings": "appliance.commands.settings:settings_app",
    "token": "appliance.commands.token:token",
    "whoami": "appliance.commands.token:whoami",
    "users": "appliance.commands.users:users_app",
    "keys": "appliance.commands.keys:keys_app",
    "adapters": "appliance.commands.adapters:adapters_app",
    "serving": "appliance.commands.serving:serving_app",
    "tls": "appliance.commands.tls:tls_app",
    "alerts": "appliance.commands.alerts:alerts",
}

# What `appliance --help` says of each command, in its order, without importing any: the first
# sentence of the command's own help (tests/unit/test_cli.py checks that they agree).
SUMMARIES = {
    "up": "Start supervisord and every engine pool; wait until each answers; print what runs where.",
    "down": "Stop every program and supervisord, and end any process they left behind.",
    "status": "Programs as supervisord sees them: state, health, uptime, GPUs, model and what each serves.",
    "settings": "Show the settings file, its defaults and the values in effect; change one setting; apply the "
                "changes to the running appliance.",
    "token": "Log in (device code by default; a password for scripts), cache the token 0600, refresh it.",
    "whoami": "Who the cached login is: user, roles, client, and when its access and refresh tokens expire.",
    "users": "Users and roles of the realm (through the gateway's admin API).",
    "keys": "API keys for applications: create (shown once), list, limit, revoke, remove.",
    "alerts": "Alerts firing now, the most urgent first: name, severity, since, what it is about, summary.",
    "adapters": "LoRA adapters: list, deploy into the running engine, canary, roll back, retire (through the "
                "gateway's admin API).",
    "serving": "Tiers, replicas, routing, the response cache and batches (through the gateway's admin API).",
    "hosts": "Hosts of a cluster (on the head): invite a worker, list them, remove one.",
    "join": "Join the head's cluster with the token on standard input (`appliance hosts add` printed it), get the "
            "weights, and start this host's ranks under its own supervisord.",
    "profile": "Detect this host's GPUs (NVML), CPU, RAM, NUMA nodes, disks and NICs (/proc, /sys).",
    "preflight": "Pass/warn/fail checks before install or `up`: GPUs, driver, disk, RAM, ports, Java.",
    "plan": "Plan TP x PP x DP x EP for MODEL; exit 0 with a feasible plan, 3 when none fits.",
    "stage": "Stage SOURCE for a plan: each host gets only what its ranks load; resumable, verified.",
    "model": "Models on this host.",
    "keycloak": "The embedded Keycloak.",
    "tls": "The gateway's HTTPS: the CA certificate to give clients, the certificate it shows, renewal.",
    "bundle": "Air-gapped bundles: build, verify the signature and every file, join split parts.",
    "backup": "Backups of the state: create while serving, verify, restore into a fresh state directory, list "
              "those in the artifact store.",
    "data": "Training datasets: validated, scanned, stored content-addressed.",
    "finetune": "Train LoRA/QLoRA adapters on stored datasets.",
    "rl": "Post-training from execution feedback: task sets, the sandbox, runs, trajectories.",
    "audit": "The tamper-evident audit log.",
    "tui": "The administrator's terminal UI: services, GPUs, traffic, models and plan, adapters and jobs, users, "
           "audit.",
}


@functools.cache
def command_targets() -> dict[str, str]:
    """Every command: name -> "module:attribute", in the order `appliance --help` lists them."""
    from importlib.metadata import distribution

    # This distribution's own entry points: reading them is instant, scanning every installed one is not.
    contributed = distribution("appliance").entry_points.select(group=COMMANDS_GROUP)
    targets = {**{ep.name: ep.value for ep in contributed}, **CORE_COMMANDS}  # no package replaces a core command
    unsummarised = sorted(set(targets) - set(SUMMARIES))  # listed last, and test_cli asks for their summary
    return {name: targets[name] for name in [*(name for name in SUMMARIES if name in targets), *unsummarised]}


def load_command(name: str, target: str) -> _click.Command:
    """Import the command's module and make the Click command of its Typer app or function, its
    help in the root's style (help_style.plain_help)."""
    module, _, attribute = target.partition(":")
    found = getattr(importlib.import_module(module), attribute)
    command: _click.Command
    if isinstance(found, typer.Typer):
        command = typer.main.get_group(found)
    else:  # a command function: a Typer of one command is that command
        single = typer.Typer(add_completion=False)  # completion is the root's option
        single.command(name)(found)
        command = typer.main.get_command(single)
    command.name = name
    return plain_help(command)


class CommandTable(TyperGroup):
    """The root group. It lists its commands from the tables above (help, completion, "did you
    mean") and imports one only when it resolves it to run."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        for name in command_targets():
            self.add_command(TyperCommand(name, short_help=SUMMARIES.get(name, "")))

    def resolve_command(self, ctx: _click.Context, args: list[str]
                        ) -> tuple[str | None, _click.Command | None, list[str]]:
        name, _, rest = super().resolve_command(ctx, args)
        if name is None:
            return name, None, rest
        return name, load_command(name, command_targets()[name]), rest

    def format_help(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        plain_help(self)  # here: Typer adds the completion options after the group is made
        super().format_help(ctx, formatter)


app = typer.Typer(
    cls=CommandTable,
    help="On-prem LLM appliance: serve open-weight models through vLLM under supervisord.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
_state = {"verbose": False}


@app.callback()
def _root(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show tracebacks on errors.")] = False,
) -> None:
    _state["verbose"] = verbose


def main() -> None:
    """Console-script entry: run the app; an ApplianceError becomes one line and exit code 1."""
    os.umask(PRIVATE_UMASK)  # whatever it writes in the state directory, and what it starts, is its own
    try:
        app()  # standalone: usage errors, --help and exit codes are handled by Typer
    except ApplianceError as exc:
        import traceback

        from rich.console import Console
        from rich.text import Text

        from appliance.terminal import shown

        line = exc.one_line()
        _record(line)
        err = Console(stderr=True)
        err.print(Text("error: ", style="red") + shown(line), soft_wrap=True)  # never markup: it may quote input
        if _state["verbose"]:
            err.print(traceback.format_exc())
        raise SystemExit(1) from None


def _record(line: str) -> None:
    """Append a reported error to the appliance log, if the state directory exists."""
    from appliance.lifecycle import appliance_log

    log = appliance_log(Home.from_env())
    if log.parent.is_dir():
        with log.open("a") as handle:
            handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} error: {line}\n")
