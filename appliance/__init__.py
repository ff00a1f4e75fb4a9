"""The appliance's shared core: state directory, settings, secrets, supervised programs."""

from appliance.errors import ApplianceError, SettingsError, StartError, StateError, SupervisorError
from appliance.home import Home
from appliance.programs import Program
from appliance.secrets import secret
from appliance.settings import EngineSettings, PoolSettings, Settings, load_settings

__all__ = [
    "ApplianceError",
    "EngineSettings",
    "Home",
    "PoolSettings",
    "Program",
    "SettingsError",
    "Settings",
    "StartError",
    "StateError",
    "SupervisorError",
    "load_settings",
    "secret",
]
