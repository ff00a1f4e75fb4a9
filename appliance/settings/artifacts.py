"""The artifact store's settings: a local directory or an S3 bucket."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from appliance.settings.section import Section


class ArtifactSettings(Section):
    """The artifact store: where copies leave this host's state dir (audit archives first)."""

    IN_SUPERVISOR_CONFIG = False  # read by the programs from the settings file

    store: Literal["local", "s3"] = Field(
        "local", description="'local' (a directory) or 's3' (an S3-compatible bucket via minio)."
    )
    path: str | None = Field(None, description="Directory of the local store (unset: <state dir>/artifacts).")
    s3_endpoint: str | None = Field(None, description="host:port of the S3-compatible server.")
    s3_bucket: str = Field("appliance-artifacts", description="Bucket; created with Object Lock if missing.")
    s3_region: str = Field("us-east-1", description="Region the bucket lives in.")
    s3_secure: bool = Field(True, description="Use HTTPS to the S3 server.")
    s3_access_key: str | None = Field(None, description="S3 access key id.")
    s3_secret_key: str | None = Field(None, description="S3 secret key (masked by the admin API).")

    @model_validator(mode="after")
    def _s3_needs_endpoint_and_keys(self) -> ArtifactSettings:
        if self.store == "s3":
            missing = [f"s3_{name}" for name in ("endpoint", "access_key", "secret_key")
                       if not getattr(self, f"s3_{name}")]
            if missing:
                raise ValueError(f"store 's3' needs {', '.join(missing)}")
        return self
