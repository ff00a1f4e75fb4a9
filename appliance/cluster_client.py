"""A worker host's side of talking to its head: HTTPS trusting only the CA pinned when the host
joined, and the credential the head gave it (every program of the worker's that asks the head
for something: the ranks' agent, the training node)."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx

from appliance.home import Home
from appliance.tls import tls_dir

CREDENTIAL_SECRET = "cluster-credential"


def head_ca_file(home: Home) -> Path:
    return tls_dir(home) / "head-ca.pem"


def head_client(home: Home, head_url: str, name: str | None = None, credential: str | None = None,
                timeout: float = 30) -> httpx.Client:
    """HTTPS to the head, trusting only the CA pinned at join."""
    headers = {"X-Appliance-Host": name, "Authorization": f"Bearer {credential}"} if name and credential else {}
    context = ssl.create_default_context(cafile=str(head_ca_file(home)))
    return httpx.Client(base_url=head_url, verify=context, headers=headers, timeout=timeout)


def credential(home: Home) -> str:
    return (home.secrets / CREDENTIAL_SECRET).read_text().strip()
