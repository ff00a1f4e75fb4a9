"""The cluster's commands. On the head, `appliance hosts add`, `list` and `remove`: invite the worker
hosts a pool's plan names, see who joined, revoke a host. On a worker, `appliance join HEAD_URL`: become a
worker of the head's cluster and start its ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import TypeAdapter, ValidationError
from rich.console import Console

from appliance import hosts, lifecycle
from appliance.changes import note_target, records_change
from appliance.commands.common import AsJson, print_json
from appliance.errors import Invalid, SettingsError
from appliance.home import Home
from appliance.records import HostName
from appliance.settings import load_settings
from appliance.terminal import Listing, text
from appliance.tls import ca_sha256
from serve.cluster_worker import join, read_token

hosts_app = typer.Typer(help="Hosts of a cluster (on the head): invite a worker, list them, remove one.",
                        no_args_is_help=True)
out = Console()
err = Console(stderr=True)


def _host_name(name: str) -> str:
    try:
        return TypeAdapter(HostName).validate_python(name)
    except ValidationError as exc:
        raise Invalid(f"host name {name[:80]!r}: letters, digits and . _ - between them, at most 253 "
                      "characters") from exc


@hosts_app.command("add")
@records_change("hosts.add")
def add(name: Annotated[str, typer.Argument(help="The host's name, as the pool's plan names it.")]) -> None:
    """Invite NAME: print its one-time join token (shown only now; it expires after cluster.join_token_ttl_s)."""
    home = Home.from_env().ensure()
    settings = load_settings(home.settings_file)
    cluster = settings.cluster
    if cluster.bind is None:
        raise SettingsError("cluster.bind is unset: workers have nothing to join",
                            hint="set it to this host's address on the cluster network, then `appliance down` "
                                 "and `appliance up`")
    host = _host_name(name)
    note_target("host", host)
    token = hosts.invite(home, host, cluster.join_token_ttl_s, ca_sha256(home))
    bind = str(cluster.bind)
    url = f"https://{f'[{bind}]' if ':' in bind else bind}:{cluster.port}"
    typer.echo(token)
    err.print(f"On {name}, with this token on standard input (never on a command line): "
              f"appliance join {url} < TOKEN_FILE  (valid {cluster.join_token_ttl_s} s, once)",
              soft_wrap=True, highlight=False, markup=False)


@hosts_app.command("list")
def list_hosts(as_json: AsJson = False) -> None:
    """Invited and joined hosts, their address and state."""
    registry = hosts.load(Home.from_env())
    if as_json:
        # the digests of tokens and credentials stay on the head: nothing a script needs
        print_json([host.model_dump(mode="json", exclude={"token_sha256", "credential_sha256"})
                    for host in registry.hosts.values()])
        return
    table = Listing("host", "state", "address", "joined", text("problem"))
    for host in registry.hosts.values():
        table.add_row(host.name, host.state.value, host.address or "-",
                      host.joined_at.isoformat(timespec="seconds") if host.joined_at else "-",
                      host.problem or "")  # a listing shows it as text: never markup
    out.print(table, crop=False)


@hosts_app.command("remove")
@records_change("hosts.remove")
def remove(name: Annotated[str, typer.Argument(help="The host to forget.")]) -> None:
    """Forget NAME: its join token and credential stop working at once."""
    host = _host_name(name)
    note_target("host", host)
    hosts.remove(Home.from_env(), host)
    out.print(f"host {name} removed")


@records_change("cluster.join")
def join_command(
    head_url: Annotated[str, typer.Argument(help="The head's cluster URL, as `appliance hosts add` printed it.")],
    weights: Annotated[Path | None, typer.Option(help="A pre-staged copy of the pool's weights, checked file by "
                                                      "file against the head's list (default: pull them).")] = None,
) -> None:
    """Join the head's cluster with the token on standard input (`appliance hosts add` printed it),
    get the weights, and start this host's ranks under its own supervisord."""
    home = Home.from_env().ensure()
    record = join(home, head_url, read_token(), weights, lambda line: err.print(line, highlight=False, markup=False))
    note_target("host", record.name)
    with err.status("starting") as spinner:
        lifecycle.up(load_settings(home.settings_file), home, progress=lambda text: spinner.update(text))
    err.print(f"{record.name} is a worker of {record.head_url}: its ranks start when the head asks "
              "(`appliance status` on the head)", highlight=False, markup=False)
