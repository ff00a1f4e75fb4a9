"""`appliance adapters ...`: the served LoRA adapters, through the gateway's admin API."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from appliance.adapters import AdapterRecord, Alias, Registry
from appliance.canary import parse_analysis
from appliance.commands.common import AsJson, admin_api, print_json
from appliance.terminal import Listing, text

adapters_app = typer.Typer(help="LoRA adapters: list, deploy into the running engine, canary, roll back, retire "
                           "(through the gateway's admin API).", no_args_is_help=True)
out = Console()


@adapters_app.command("list")
def adapters_list(as_json: AsJson = False) -> None:
    """Adapter versions with their held-out loss, state, and what each name serves."""
    registry = Registry.model_validate(admin_api("GET", "/adapters"))
    if as_json:
        print_json(registry)
        return
    table = Listing("adapter", "version", "state", "base", "held-out loss (base -> adapter)",
                    text("evaluation sets (base -> adapter)"), "dataset")
    for record in registry.adapters:
        loss = f"{record.metrics.base_eval_loss:.4f} -> {record.metrics.adapter_eval_loss:.4f}"
        sets = "\n".join(scores.line(kind) for kind, scores in record.metrics.eval_sets.items()) or "-"
        table.add_row(record.name, str(record.version), record.state, record.base_model, loss, sets, record.dataset)
    out.print(table, crop=False)
    for name, alias in sorted(registry.aliases.items()):
        serves = f"v{alias.stable}" if alias.stable is not None else "no version (requests for it are refused)"
        if alias.canary is not None:
            serves += f", canary v{alias.canary} ({alias.canary_share:.0%})"
        out.print(f"{name}: {serves} on pool {alias.pool}, for roles {', '.join(alias.roles)}")


@adapters_app.command("deploy")
def adapters_deploy(
    name: Annotated[str, typer.Argument(help="Adapter name.")],
    version: Annotated[int | None, typer.Option(min=1, help="Default: the newest that passed its gate.")] = None,
    pool: Annotated[str | None, typer.Option(help="Engine pool (default: as before, else the first).")] = None,
    role: Annotated[list[str] | None, typer.Option("--role", help="Role allowed to call it; repeatable "
                                                   "(default: as before, else user and admin).")] = None,
) -> None:
    """Hot-load a version into the running engine and serve it under its name."""
    alias = Alias.model_validate(admin_api("POST", f"/adapters/{name}/deploy",
                                           json={"version": version, "pool": pool, "roles": role}))
    out.print(f"{name} serves v{alias.stable} on pool {alias.pool}")


@adapters_app.command("canary")
def adapters_canary(
    name: Annotated[str, typer.Argument(help="Adapter name.")],
    version: Annotated[int, typer.Option(min=1, help="The version to try.")],
    share: Annotated[float, typer.Option(min=0, max=1, help="Fraction of requests it gets, e.g. 0.1.")],
    analysis: Annotated[str | None, typer.Option(
        help="Promote or abort it by its numbers against the stable version: key=value pairs joined by commas, "
             "e.g. window_s=60,windows=3,min_requests=20 (docs/post-train/lora.md names them all).")] = None,
) -> None:
    """Send a share of the name's requests to another version."""
    policy = parse_analysis(analysis) if analysis is not None else None
    answer = admin_api("POST", f"/adapters/{name}/canary",
                       json={"version": version, "share": share,
                             "analysis": policy.model_dump() if policy is not None else None})
    alias = Alias.model_validate(answer)
    out.print(f"{name}: v{alias.canary} gets {alias.canary_share:.0%} of requests, v{alias.stable} the rest")
    if alias.canary_analysis is not None:
        judged = alias.canary_analysis
        out.print(f"judged every {judged.window_s} s: promoted after {judged.windows} passing windows, aborted by "
                  f"any failing one (`appliance adapters show-canary {name}` shows it)")


@adapters_app.command("show-canary")
def adapters_show_canary(name: Annotated[str, typer.Argument(help="Adapter name.")], as_json: AsJson = False) -> None:
    """A canary as it runs: its share and, when it is judged, both versions' figures in the current window."""
    status = admin_api("GET", f"/adapters/{name}/canary")
    if as_json:
        print_json(status)
        return
    out.print(f"{name}: v{status['canary']} gets {status['canary_share']:.0%} of requests, v{status['stable']} "
              "the rest")
    window = status["analysis"]
    if window is None:
        out.print("not judged: it stays until you deploy a version or roll it back")
        return
    out.print(f"v{status['canary']} against v{status['stable']}: {window['passed_windows']} of "
              f"{window['policy']['windows']} passing windows so far, {window['window_left_s']:.0f} s left in this one")
    table = Listing("version", "requests", "error rate", "latency p50 (s)", "ttft p50 (s)", "success", "satisfaction")
    for role in ("stable", "canary"):
        figures = window[f"{role}_figures"]
        table.add_row(f"v{status[role]} ({role})", *(("-" if figures[key] is None else str(figures[key]))
                                                     for key in ("requests", "error_rate", "latency_p50_s",
                                                                 "ttft_p50_s", "success_rate", "satisfaction")))
    out.print(table, crop=False)


@adapters_app.command("rollback")
def adapters_rollback(name: Annotated[str, typer.Argument(help="Adapter name.")]) -> None:
    """Drop the canary; without one, serve the version served before (past the first: none)."""
    alias = Alias.model_validate(admin_api("POST", f"/adapters/{name}/rollback"))
    if alias.stable is None:
        out.print(f"{name} has no version deployed: requests for it are refused until you deploy one "
                  f"(`appliance adapters deploy {name}`)")
    else:
        out.print(f"{name} serves v{alias.stable}")


@adapters_app.command("retire")
def adapters_retire(
    name: Annotated[str, typer.Argument(help="Adapter name.")],
    version: Annotated[int | None, typer.Option(min=1, help="Default: every version, and the name.")] = None,
) -> None:
    """Retire a version that is not served, or the whole name."""
    retired = [AdapterRecord.model_validate(r) for r in admin_api("POST", f"/adapters/{name}/retire",
                                                                   json={"version": version})]
    out.print("retired " + ", ".join(f"{r.name} v{r.version}" for r in retired))
