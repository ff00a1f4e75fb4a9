"""A joining worker trusts exactly the head CA its token names (regression: a second
certificate sent after the real one was trusted too)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from appliance.cluster_client import head_ca_file
from appliance.errors import Invalid, Unavailable
from appliance.home import Home
from appliance.tls import ca_file, ca_sha256
from serve.cluster_worker import _pin_ca


class Answer:
    def __init__(self, text: str) -> None:
        self.text = text


def test_only_the_pinned_certificate_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    head, impostor, worker = (Home(tmp_path / name).ensure() for name in ("head", "impostor", "w"))
    pin = ca_sha256(head)
    ca_sha256(impostor)
    real, other = ca_file(head).read_text(), ca_file(impostor).read_text()
    monkeypatch.setattr(httpx, "get", lambda *a, **k: Answer(real + other))
    with pytest.raises(Unavailable, match="not exactly one PEM certificate"):
        _pin_ca(worker, "https://10.0.0.1:8443", pin)
    monkeypatch.setattr(httpx, "get", lambda *a, **k: Answer(other))
    with pytest.raises(Invalid, match="not the head that invited this host"):
        _pin_ca(worker, "https://10.0.0.1:8443", pin)
    monkeypatch.setattr(httpx, "get", lambda *a, **k: Answer("junk\n" + real))
    _pin_ca(worker, "https://10.0.0.1:8443", pin)
    kept = head_ca_file(worker).read_text()
    assert kept.count("BEGIN CERTIFICATE") == 1 and kept.strip() == real.strip()
