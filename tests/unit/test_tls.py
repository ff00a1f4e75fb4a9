"""The appliance's CA and the channel to Keycloak: a server it certified is trusted, an impostor on
Keycloak's port (plain or with a certificate of its own) gets a TLS handshake and nothing else."""

from __future__ import annotations

import asyncio
import base64
import datetime
import os
import socket
import ssl
import stat
import threading
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from appliance import tls
from appliance.errors import StateError
from appliance.home import Home
from appliance.settings import KeycloakSettings, Settings
from serve.auth import AuthError, Introspector, Principal, TokenValidator
from tests.support.impostor import Impostor

SECRET = "the-gateway-client-secret"


def _serve_tls_once(certificate: tuple[Path, Path]) -> tuple[int, threading.Thread]:
    """A TLS server on loopback that answers one request (the genuine Keycloak's role)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            try:
                with context.wrap_socket(conn, server_side=True) as tls_conn:
                    tls_conn.recv(65536)
                    tls_conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            except ssl.SSLError:  # a client that does not trust the certificate
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


def test_the_ca_issues_a_loopback_certificate_its_clients_verify(home: Home) -> None:
    certificate = tls.ensure_server_certificate(home, "keycloak")
    assert stat.S_IMODE(certificate[1].stat().st_mode) == 0o600
    assert stat.S_IMODE((home.secrets / tls.CA_KEY).stat().st_mode) == 0o600
    assert stat.S_IMODE(tls.ca_file(home).stat().st_mode) == 0o644
    port, server = _serve_tls_once(certificate)
    answer = httpx.get(f"https://127.0.0.1:{port}/", verify=tls.keycloak_ssl(Settings(), home))
    server.join(5)
    assert answer.text == "ok"
    # Not a certificate anyone else trusts: the system's trust store refuses it.
    port, _ = _serve_tls_once(certificate)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://127.0.0.1:{port}/")


def test_certificates_are_kept_and_reissued_near_their_end(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    cert_path, _ = tls.ensure_server_certificate(home, "keycloak")
    first = cert_path.read_bytes()
    ca = tls.ca_file(home).read_bytes()
    assert tls.ensure_server_certificate(home, "keycloak")[0].read_bytes() == first
    monkeypatch.setattr(tls, "RENEW_BEFORE", datetime.timedelta(days=tls.SERVER_DAYS))
    renewed = x509.load_pem_x509_certificate(tls.ensure_server_certificate(home, "keycloak")[0].read_bytes())
    assert renewed.serial_number != x509.load_pem_x509_certificate(first).serial_number
    assert tls.ca_file(home).read_bytes() == ca  # the same CA: clients keep trusting


def test_a_broken_ca_is_an_error_not_a_new_ca(home: Home) -> None:
    tls.ensure_ca(home)
    (home.secrets / tls.CA_KEY).unlink()
    with pytest.raises(StateError, match="exists without its pair"):
        tls.ensure_server_certificate(home, "keycloak")
    tls.ca_file(home).unlink()
    tls.ensure_ca(home)
    os.chmod(home.secrets / tls.CA_KEY, 0o644)
    with pytest.raises(StateError, match="readable by others"):
        tls.ensure_ca(home)


def test_trust_is_the_appliance_ca_or_the_external_keycloak_s(tmp_path: Path, home: Home) -> None:
    with pytest.raises(StateError, match="CA .* does not exist yet"):
        tls.keycloak_trust(Settings(), home)
    tls.ensure_ca(home)
    assert tls.keycloak_trust(Settings(), home) == str(tls.ca_file(home))
    external = KeycloakSettings(mode="external", url="https://idp.corp", gateway_client_secret="s")
    assert tls.keycloak_trust(Settings(keycloak=external), home) is True
    missing = external.model_copy(update={"ca_file": str(tmp_path / "corp-ca.pem")})
    with pytest.raises(StateError, match="keycloak.ca_file: .*corp-ca.pem is not a file"):
        tls.keycloak_trust(Settings(keycloak=missing), home)
    (tmp_path / "corp-ca.pem").write_bytes(tls.ca_file(home).read_bytes())
    assert tls.keycloak_trust(Settings(keycloak=missing), home) == str(tmp_path / "corp-ca.pem")


@pytest.mark.parametrize("impostor_tls", [False, True], ids=["plain", "own-certificate"])
def test_an_impostor_on_keycloaks_port_gets_neither_the_secret_nor_a_token(tmp_path: Path, impostor_tls: bool) -> None:
    """Keycloak restarts; a local process takes its port. The gateway's introspection (with its
    client secret) and key fetch reach it, fail the handshake and send nothing else."""
    home = Home(tmp_path / "appliance").ensure()
    tls.ensure_server_certificate(home, "keycloak")
    attacker = tls.ensure_server_certificate(Home(tmp_path / "attacker").ensure(), "keycloak") if impostor_tls else None
    principal = Principal(subject="u", username="u", client="appliance-cli", roles=frozenset({"user"}), token_id="t",
                          expires_at=0)

    async def attempt(port: int) -> tuple[AuthError, Exception]:
        issuer = f"https://127.0.0.1:{port}/realms/appliance"
        async with httpx.AsyncClient(verify=tls.keycloak_ssl(Settings(), home)) as http:
            introspect = Introspector(issuer=issuer, client_id="appliance-gateway", client_secret=SECRET,
                                      http=http, ttl_s=10)
            with pytest.raises(AuthError) as refused:
                await introspect.check("a.token.here", principal)
            validator = TokenValidator(issuer=issuer, audience="appliance-gateway", http=http)
            with pytest.raises(httpx.ConnectError) as no_keys:
                await validator.refresh_keys()
        return refused.value, no_keys.value

    with Impostor(certificate=attacker) as impostor:
        refused, no_keys = asyncio.run(attempt(impostor.port))
    assert refused.status == 503 and refused.code == "introspection_unavailable"
    if impostor_tls:
        assert "CERTIFICATE_VERIFY_FAILED" in str(no_keys)
    assert len(impostor.received) == 2  # both reached it: the channel, not luck, kept the secret
    sent = impostor.everything()
    basic = base64.b64encode(f"appliance-gateway:{SECRET}".encode())
    assert SECRET.encode() not in sent and basic not in sent and b"HTTP/1.1" not in sent
    if not impostor_tls:
        assert all(raw.startswith(b"\x16\x03") for raw in impostor.received)  # a TLS ClientHello, no request
