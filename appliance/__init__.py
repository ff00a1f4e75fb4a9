"""The appliance's shared core: state directory, settings, secrets, supervised programs.

Its public names are imported when first used (appliance.lazy): `import appliance.home` must not
build the settings' schemas, so the CLI and every supervised program load only the modules they use."""

from appliance.lazy import lazy_exports

_HOMES = {
    "ApplianceError": "appliance.errors", "SettingsError": "appliance.errors", "StartError": "appliance.errors",
    "StateError": "appliance.errors", "SupervisorError": "appliance.errors", "Home": "appliance.home",
    "Program": "appliance.programs", "secret": "appliance.secrets", "EngineSettings": "appliance.settings",
    "PoolSettings": "appliance.settings", "Settings": "appliance.settings", "load_settings": "appliance.settings",
}
__all__ = sorted(_HOMES)
__getattr__ = lazy_exports(__name__, _HOMES)
