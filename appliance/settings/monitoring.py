"""Monitoring's settings: Prometheus, Alertmanager and where alerts go."""

from __future__ import annotations

import re
import urllib.parse

from pydantic import Field, field_validator, model_validator

from appliance.settings.section import DNS_NAME, Port, Section, is_address, is_loopback

_URL_TAIL = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@%/?-]*", re.ASCII)  # RFC 3986's path and query characters
_LIBRARY_PATH = re.compile(r"/[A-Za-z0-9/._+-]{1,4095}", re.ASCII)


class MonitoringSettings(Section):
    """Prometheus and Alertmanager under supervisord, on loopback only, each behind a password of
    the appliance's: the metrics, the shipped alert rules, and where alerts go."""

    enabled: bool = Field(True, description="Run Prometheus and Alertmanager (Debian's `prometheus` and "
                          "`prometheus-alertmanager` packages; bootstrap installs them).")
    prometheus_port: Port = Field(9090, description="Prometheus's loopback port.")
    alertmanager_port: Port = Field(9093, description="Alertmanager's loopback port.")
    scrape_interval_s: int = Field(15, ge=1, le=300, description="How often Prometheus scrapes and evaluates the "
                                   "alert rules.")
    retention_days: int = Field(15, ge=1, le=3650, description="Prometheus keeps samples this long...")
    retention_mb: int = Field(2048, ge=64, le=1 << 24, description="...and at most this much disk (the oldest "
                              "blocks go first).")
    webhook_url: str | None = Field(
        None, description="Where Alertmanager posts firing and resolved alerts (its webhook format): an https "
        "URL, or http to a loopback address; unset: alerts are only shown (`appliance alerts`, status, the TUI).")
    nvml_library: str | None = Field(
        None, description="The NVML library the GPU metrics and dashboards read, where the driver's "
        "libnvidia-ml.so.1 is not on the loader's path: an absolute path to a file owned by root (or the "
        "appliance's user) that no one else may write; unset: the loader's.")

    @field_validator("nvml_library")
    @classmethod
    def _nvml_library(cls, path: str | None) -> str | None:
        if path is not None and (not _LIBRARY_PATH.fullmatch(path) or ".." in path.split("/")):
            raise ValueError(f"{path[:120]!r}: an absolute path of letters, digits and . _ + - (no '..' part, "
                             "at most 4096 characters)")
        return path

    @field_validator("webhook_url")
    @classmethod
    def _webhook(cls, url: str | None) -> str | None:
        """http(s)://HOST[:PORT][/PATH]: no user or password in it, plain http to loopback only."""
        if url is None:
            return None
        if len(url) > 2048 or url != url.strip():
            raise ValueError(f"{url[:120]!r}: at most 2048 characters, no space around it")
        parsed = urllib.parse.urlsplit(url)
        try:
            if parsed.port == 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"{url[:120]!r}: its port is not a number from 1 to 65535") from None
        host = parsed.hostname or ""
        if (parsed.scheme not in ("http", "https") or parsed.username is not None or parsed.password is not None
                or parsed.fragment or not (DNS_NAME.fullmatch(host) or is_address(host))
                or not _URL_TAIL.fullmatch(f"{parsed.path}{'?' if parsed.query else ''}{parsed.query}")):
            raise ValueError(f"{url[:120]!r} is not http(s)://HOST[:PORT][/PATH][?QUERY] (a DNS name or address, "
                             "no user or password, the path and query in URL characters: others %-escaped)")
        if parsed.scheme == "http" and not is_loopback(host):
            raise ValueError(f"{url[:120]!r}: alerts leave this host over https only (plain http to a loopback "
                             "address)")
        return url

    @model_validator(mode="after")
    def _ports_differ(self) -> MonitoringSettings:
        if self.prometheus_port == self.alertmanager_port:
            raise ValueError("prometheus_port and alertmanager_port must differ")
        return self
