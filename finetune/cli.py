"""`appliance data ...`: import and list training datasets."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from appliance.artifacts import artifact_store
from appliance.changes import records_change
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.settings import DEMO_MODEL, load_settings
from finetune.datasets import check_lengths, load_registry, parse, scan, split, store
from finetune.pii import Scanner

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
data_app = typer.Typer(help="Training datasets: validated, scanned, stored content-addressed.",
                       no_args_is_help=True)
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
