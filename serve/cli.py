"""`appliance join HEAD_URL`: make this host a worker of the head's cluster and start its ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from appliance import lifecycle
from appliance.changes import records_change
from appliance.home import Home
from appliance.settings import load_settings
from serve.cluster_worker import join, read_token

err = Console(stderr=True)
_joined: dict[str, str] = {}


@records_change("cluster.join", detail=lambda: _joined.get("as", ""))
def join_command(
    head_url: Annotated[str, typer.Argument(help="The head's cluster URL, as `appliance hosts add` printed it.")],
    weights: Annotated[Path | None, typer.Option(help="A pre-staged copy of the pool's weights, checked file by "
                                                      "file against the head's list (default: pull them).")] = None,
) -> None:
    """Join the head's cluster with the token on standard input (`appliance hosts add` printed it),
    get the weights, and start this host's ranks under its own supervisord."""
    home = Home.from_env().ensure()
    record = join(home, head_url, read_token(), weights, lambda line: err.print(line, highlight=False, markup=False))
    _joined["as"] = f"joined {record.head_url} as {record.name}"
    with err.status("starting") as spinner:
        lifecycle.up(load_settings(home.settings_file), home, progress=lambda text: spinner.update(text))
    err.print(f"{record.name} is a worker of {record.head_url}: its ranks start when the head asks "
              "(`appliance status` on the head)", highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    """The `appliance.commands` entry point."""
    app.command("join")(join_command)
