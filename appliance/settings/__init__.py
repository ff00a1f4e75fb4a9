"""Typed settings: a TOML file in the state directory, then APPLIANCE_* environment overrides.

Every field has a default, a constraint and a one-line description; `appliance settings defaults`
prints them as a commented TOML file. One module per concern:

- section: what every section shares (its base model, ports, host names)
- engines, keycloak, gateway, routing, batch, artifacts, audit, backup, monitoring, watchdog,
  finetune, rl, compliance: the sections
- root: `Settings`, every section composed
- loading: the file and the environment read, errors naming file and line, or the variable
- rendering: the defaults written back as a commented settings.toml
"""

from appliance.settings.artifacts import ArtifactSettings
from appliance.settings.batch import BatchSettings
from appliance.settings.compliance import (
    DEFAULT_ANSWERS,
    DEFAULT_PROMPTS,
    CompliancePolicy,
    ComplianceSettings,
    RolePolicy,
    SensitiveAction,
)
from appliance.settings.engines import DEMO_MODEL, EngineSettings, PoolSettings
from appliance.settings.finetune import FinetuneSettings
from appliance.settings.gateway import WHOLE_CONTEXT, GatewaySettings, RoleLimits
from appliance.settings.keycloak import KeycloakSettings
from appliance.settings.loading import load_settings
from appliance.settings.monitoring import MonitoringSettings
from appliance.settings.rendering import render_defaults
from appliance.settings.rl import ExecutionSettings, RlSettings
from appliance.settings.root import Settings
from appliance.settings.routing import CacheSettings, RoutingSettings
from appliance.settings.watchdog import WatchdogSettings

# What the other packages import from here; the sections' own modules hold the rest.
__all__ = [
    "DEFAULT_ANSWERS",
    "DEFAULT_PROMPTS",
    "DEMO_MODEL",
    "WHOLE_CONTEXT",
    "ArtifactSettings",
    "BatchSettings",
    "CacheSettings",
    "CompliancePolicy",
    "ComplianceSettings",
    "EngineSettings",
    "ExecutionSettings",
    "FinetuneSettings",
    "GatewaySettings",
    "KeycloakSettings",
    "MonitoringSettings",
    "PoolSettings",
    "RlSettings",
    "RoleLimits",
    "RolePolicy",
    "RoutingSettings",
    "SensitiveAction",
    "Settings",
    "WatchdogSettings",
    "load_settings",
    "render_defaults",
]
