"""`appliance data ...`: import and list training datasets."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from appliance.artifacts import artifact_store
from appliance.changes import records_change
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.records import config_sha256
from appliance.settings import DEMO_MODEL, load_settings
from finetune import adapters
from finetune.datasets import PREFIX, check_lengths, load_registry, parse, scan, split, store
from finetune.pii import Scanner
from finetune.train import Hyperparameters, Progress, train_adapter
from appliance.progress import byte_progress

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
data_app = typer.Typer(help="Training datasets: validated, scanned, stored content-addressed.",
                       no_args_is_help=True)
finetune_app = typer.Typer(help="Train LoRA/QLoRA adapters on stored datasets.", no_args_is_help=True)
out = Console()


@data_app.command("add")
@records_change("data.add")
def add(
    file: Annotated[Path, typer.Argument(help="JSONL (messages, or prompt/completion) or .txt.")],
    name: Annotated[str, typer.Option(help="Name to refer to the dataset by.")],
    model: Annotated[str, typer.Option(help="'demo' or a checkpoint directory: its tokenizer and chat "
                                            "template measure each row.")] = DEMO_MODEL,
    context: Annotated[int | None, typer.Option(min=1, help="Longest row in tokens "
                                                "(default: engine.max_model_len).")] = None,
) -> None:
    """Validate every row, scan for sensitive data, split train/eval, store; all or nothing."""
    if not NAME.match(name):
        raise ApplianceError(f"--name {name!r}: use lower-case letters, digits, '.', '_' or '-' (up to 64)")
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    rows = parse(file)
    check_lengths(rows, _token_counter(home.demo_model if model == DEMO_MODEL else Path(model)),
                  context or settings.engine.max_model_len)
    options = settings.finetune
    rows, sensitive = scan(rows, Scanner(options.sensitive_patterns), options.sensitive_data)
    train, evaluation = split(rows, options.eval_fraction)
    done = store(name, file, train, evaluation, sensitive, options.sensitive_data,
                 artifact_store(settings.artifacts, home), home)
    found = ", ".join(f"{kind} {count}" for kind, count in sorted(sensitive.items())) or "none"
    out.print(f"dataset {done.name}: {done.rows} rows ({done.train} train, {done.eval} eval), sha256 {done.digest}; "
              f"sensitive data: {found} ({done.action})", soft_wrap=True)


@data_app.command("list")
def list_datasets() -> None:
    """Datasets by name and content hash."""
    table = Table("name", "sha256")
    for name, digest in sorted(load_registry(Home.from_env()).items()):
        table.add_row(name, digest)
    out.print(table)


@finetune_app.command("run")
@records_change("adapter.train")
def run(
    data: Annotated[str, typer.Option(help="A dataset name from `appliance data list`.")],
    name: Annotated[str, typer.Option(help="Adapter name; each run registers its next version.")],
    base: Annotated[str, typer.Option(help="'demo' or a checkpoint directory.")] = DEMO_MODEL,
    qlora: Annotated[bool, typer.Option(help="Load the base in 4-bit NF4 (bitsandbytes).")] = False,
    rank: Annotated[int, typer.Option(min=1)] = 8,
    alpha: Annotated[int, typer.Option(min=1)] = 16,
    lr: Annotated[float, typer.Option(min=0)] = 2e-4,
    epochs: Annotated[float, typer.Option(min=0)] = 1.0,
    max_steps: Annotated[int, typer.Option(help="> 0 overrides --epochs.")] = -1,
    batch_size: Annotated[int, typer.Option(min=1)] = 4,
    save_steps: Annotated[int, typer.Option(min=1, help="Checkpoint every N steps (a rerun resumes).")] = 10,
) -> None:
    """Train an adapter in the foreground, gate it on held-out loss, register it."""
    if not NAME.match(name):
        raise ApplianceError(f"--name {name!r}: use lower-case letters, digits, '.', '_' or '-' (up to 64)")
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    registry = load_registry(home)
    if data not in registry:
        raise ApplianceError(f"no dataset named {data!r}", hint=f"datasets: {sorted(registry) or 'none'}")
    store = artifact_store(settings.artifacts, home)
    digest = registry[data]
    rows = [[json.loads(line) for line in store.get(f"{PREFIX}{digest}/{split}.jsonl").decode().splitlines()]
            for split in ("train", "eval")]
    base_dir = home.demo_model if base == DEMO_MODEL else Path(base)
    hp = Hyperparameters(rank=rank, alpha=alpha, learning_rate=lr, epochs=epochs, max_steps=max_steps,
                         batch_size=batch_size, save_steps=save_steps, qlora=qlora)
    work = home.root / "finetune" / f"{name}-{digest[:12]}"
    with byte_progress() as progress:
        task = progress.add_task("training", total=None, unit="steps")

        def show(p: Progress) -> None:
            progress.update(task, completed=p.step, total=p.max_steps,
                            description=f"training: loss {p.loss:.3f}, {p.tokens_per_s:.0f} tokens/s")

        result = train_adapter(base_dir, *rows, work, hp, on_progress=show)
    gate = settings.finetune.gate_min_improvement
    passed = result.improvement > gate
    record = adapters.register(
        home, store, result.adapter_dir, name=name, base_model=base, base_config_sha256=_config_sha256(base_dir),
        dataset=data, dataset_sha256=digest, hyperparameters=asdict(hp),
        metrics={"base_eval_loss": result.base_eval_loss, "adapter_eval_loss": result.adapter_eval_loss,
                 "improvement": result.improvement, "steps": result.steps, "train_tokens": result.train_tokens,
                 "seconds": result.seconds, "resumed_from": result.resumed_from},
        state="registered" if passed else "failed-gate")
    resumed = f" (resumed from {result.resumed_from})" if result.resumed_from else ""
    out.print(f"adapter {record.name} v{record.version}: held-out loss {result.base_eval_loss:.4f} -> "
              f"{result.adapter_eval_loss:.4f} ({result.improvement:+.1%}); {result.steps} steps{resumed}; "
              f"gate (> {gate:.0%}): {'passed' if passed else 'FAILED'}; {record.artifact}", soft_wrap=True)
    if not passed:
        raise ApplianceError(f"adapter {name} v{record.version} failed the evaluation gate: held-out loss "
                             f"{result.adapter_eval_loss:.4f} vs base {result.base_eval_loss:.4f}")


def _config_sha256(model_dir: Path) -> str:
    try:
        return config_sha256(json.loads((model_dir / "config.json").read_text()))
    except (OSError, ValueError) as exc:
        raise ApplianceError(f"{model_dir}/config.json: cannot read: {exc}") from exc


def _token_counter(model_dir: Path) -> Any:
    """Tokens of an example as the model will see it: chat template applied for chats."""
    from transformers import AutoTokenizer  # heavy: imported only when a dataset is added

    if not (model_dir / "tokenizer_config.json").is_file() and not (model_dir / "tokenizer.json").is_file():
        raise ApplianceError(f"{model_dir}: no tokenizer to measure rows with",
                             hint="give --model a checkpoint directory with its tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    def count(example: dict) -> int:
        if "messages" in example:
            return len(tokenizer.apply_chat_template(example["messages"], tokenize=True))
        return len(tokenizer(example["text"]).input_ids)

    return count


def register(app: typer.Typer) -> None:
    """The `appliance.commands` entry point."""
    app.add_typer(data_app, name="data")
    app.add_typer(finetune_app, name="finetune")
