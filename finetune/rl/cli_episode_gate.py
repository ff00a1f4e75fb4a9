"""`appliance rl episodes gate`: an adapter's agent episodes on held-out repository tasks against its
base model's (finetune.rl.episode_gate), recorded on the adapter's version."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated

import typer
from rich.console import Console

from appliance.commands.common import AsJson
from appliance.errors import Invalid
from appliance.progress import byte_progress
from finetune.rl.cli_episodes import answer_options
from finetune.rl.episode_gate import held_out_tasks, judge, record, regression_check, run_trials
from finetune.rl.gate import gated

out = Console()


def gate_command(
    adapter: Annotated[str, typer.Argument(help="A deployed adapter's name (the version it serves is gated).")],
    tasks: Annotated[str, typer.Option(help="The set of repository tasks whose held-out tasks it is measured on.")],
    base: Annotated[str, typer.Option(help="The base model it was trained from (a pool's model name).")],
    trials: Annotated[int, typer.Option(min=1, max=20, help="Episodes per task and model (seeds 0 to N-1).")] = 4,
    k: Annotated[int | None, typer.Option(min=1, max=20, help="pass^k's k (at most --trials; default: "
                                                              "--trials).")] = None,
    temperature: Annotated[float, typer.Option(min=0, max=2, help="Sampling temperature.")] = 0.7,
    tool_choice: Annotated[str, typer.Option(help="auto, or required (a tool call every answer).")] = "auto",
    extra_body: Annotated[str | None, typer.Option(help="A JSON object of request fields added to every answer "
                                                        "(vLLM's sampling or structured_outputs fields).")] = None,
    max_drop: Annotated[float, typer.Option(min=0, max=1, help="How far below the base model's the differences' "
                                                               "95% intervals may reach.")] = 0.0,
    as_json: AsJson = False,
) -> None:
    """Held-out pass@1 and pass^k of the adapter's agent episodes against its base model's, each
    difference with its 95% interval (a bootstrap paired by task), and its training's regression
    check; recorded on the adapter's version; exit 1 unless both intervals' lower ends are at
    least -(--max-drop) and the regression check passed."""
    k = trials if k is None else k
    if k > trials:
        raise Invalid(f"--k {k}: at most --trials ({trials})")
    choice, extra = answer_options(tool_choice, extra_body)
    home, settings, artifacts, version = gated(adapter)
    regression = regression_check(home, adapter, version)
    held_out = held_out_tasks(home, tasks, artifacts)
    with byte_progress(stderr=True) as bar:  # standard output is the verdict (--json: JSON only)
        shown = bar.add_task("gate", total=None, unit="episodes")

        def show(line: str) -> None:
            bar.update(shown, description=line)

        before, after = (run_trials(held_out, model, trials, settings=settings, home=home, artifacts=artifacts,
                                    task_set=tasks, temperature=temperature, tool_choice=choice, extra_body=extra,
                                    show=show) for model in (base, adapter))
    outcome = judge(before, after, k, max_drop, regression)
    record(home, adapter, version, outcome)
    if as_json:
        print(json.dumps({"adapter": adapter, "version": version, "k": k, "trials": trials,
                          "base": before.passed, "adapter_passed": after.passed,
                          "base_episodes": before.episodes, "adapter_episodes": after.episodes,
                          "pass_at_1": asdict(outcome.pass_at_1), "pass_hat_k": asdict(outcome.pass_hat_k),
                          "regression": outcome.regression, "failures": outcome.failures}))
    else:
        out.print("\n".join(outcome.lines()), highlight=False, markup=False)
    if outcome.failures:
        raise typer.Exit(1)
