"""The root of the settings: every section composed, the checks across sections, and the settings
as shown (secrets masked) and digested."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import Field, model_validator

from appliance.errors import SettingsError
from appliance.settings.artifacts import ArtifactSettings
from appliance.settings.audit import AuditSettings
from appliance.settings.backup import BackupSettings
from appliance.settings.batch import BatchSettings
from appliance.settings.compliance import ComplianceSettings
from appliance.settings.engines import ClusterSettings, EngineSettings, PoolSettings
from appliance.settings.finetune import FinetuneSettings
from appliance.settings.gateway import GatewaySettings
from appliance.settings.keycloak import KeycloakSettings
from appliance.settings.monitoring import MonitoringSettings
from appliance.settings.rl import ExecutionSettings, RlSettings
from appliance.settings.routing import CacheSettings, RoutingSettings
from appliance.settings.section import Section
from appliance.settings.watchdog import WatchdogSettings

MASK = "********"
SECRET_FIELDS = (("keycloak", "gateway_client_secret"), ("artifacts", "s3_secret_key"))


class Settings(Section):
    """All settings, composed from one section per concern."""

    engine: EngineSettings = Field(default_factory=EngineSettings)
    keycloak: KeycloakSettings = Field(default_factory=KeycloakSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    audit: AuditSettings = Field(default_factory=AuditSettings)
    artifacts: ArtifactSettings = Field(default_factory=ArtifactSettings)
    finetune: FinetuneSettings = Field(default_factory=FinetuneSettings)
    execution: ExecutionSettings = Field(default_factory=ExecutionSettings)
    rl: RlSettings = Field(default_factory=RlSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    compliance: ComplianceSettings = Field(default_factory=ComplianceSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    backup: BackupSettings = Field(default_factory=BackupSettings)
    monitoring: MonitoringSettings = Field(default_factory=MonitoringSettings)
    watchdog: WatchdogSettings = Field(default_factory=WatchdogSettings)
    pools: list[PoolSettings] = Field(
        default_factory=lambda: [PoolSettings(name="main")],
        min_length=1,
        description="vLLM pools; each is one supervised vllm-<name> program per replica.",
    )

    @model_validator(mode="after")
    def _keycloak_frontend(self) -> Settings:
        """The embedded Keycloak is published through the gateway at its public URL, if it has one."""
        self.keycloak._frontend = self.gateway.public_url if self.keycloak.mode == "embedded" else None
        return self

    @model_validator(mode="after")
    def _pools_distinct(self) -> Settings:
        seen: set[str] = set()
        for pool in self.pools:
            if pool.name in seen:
                raise ValueError(f"two pools share name {pool.name!r}; give each its own")
            seen.add(pool.name)
        return self

    def masked(self) -> dict[str, Any]:
        """The settings as JSON data with secrets replaced by a mask (for display and digests)."""
        data = self.model_dump(mode="json")
        for section, field in SECRET_FIELDS:
            if data[section].get(field):
                data[section][field] = MASK
        return data

    def comparable(self) -> dict[str, Any]:
        """The settings as JSON data with each secret replaced by a digest of it: what a start
        records, so that a later change is seen (a changed secret too) without keeping a copy."""
        data = self.model_dump(mode="json")
        for section, field in SECRET_FIELDS:
            if data[section].get(field):
                data[section][field] = "sha256:" + hashlib.sha256(data[section][field].encode()).hexdigest()
        return data

    def digest(self) -> str:
        """A short SHA-256 of the masked settings: which configuration a start used."""
        text = json.dumps(self.masked(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def pool(self, name: str) -> PoolSettings:
        """The pool called `name`."""
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise SettingsError(f"no pool named {name!r}", hint=f"pools: {[p.name for p in self.pools]}")
