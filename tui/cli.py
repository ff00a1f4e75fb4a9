"""`appliance tui`."""

from __future__ import annotations

from appliance.home import Home
from appliance.settings import load_settings


def tui_command() -> None:
    """The administrator's terminal UI: services, GPUs, traffic, models and plan, adapters and jobs,
    users, audit. Logs in with the cached token or the device-code flow."""
    from tui.app import AdminApp  # Textual loads only when the UI is wanted

    home = Home.from_env().ensure()
    AdminApp(load_settings(home.settings_file), home).run()
