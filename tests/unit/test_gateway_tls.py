"""The gateway's HTTPS, short of a running gateway (tests/integration/test_network.py has that):
plain HTTP on a network address refused by the settings, the certificate the appliance's CA issues
for the names clients use, TLS 1.2+ with modern ciphers only, the organisation's chain shown to the
network while local clients asking for `localhost` get the CA's, a bad organisation certificate
named at `up`, and a certificate replaced while serving swapped in (a half-written or wrong pair
leaves the one in use serving)."""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import ssl
import time
import types
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from appliance import tls
from appliance.errors import SettingsError
from appliance.home import Home
from appliance.local_gateway import client_options, gateway_url
from appliance.settings import GatewaySettings, Settings, load_settings
from serve.https import GatewayTLS
from serve.programs import gateway_program
from tests.support.certificates import Chain, handshake, organisation_chain, write_key


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca)


def names_of(certificate: x509.Certificate) -> set[str]:
    sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(name.value) for name in sans}


def common_name(certificate: x509.Certificate) -> str:
    return str(certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def network(**gateway: object) -> Settings:
    return Settings(gateway=GatewaySettings.model_validate({"bind": "0.0.0.0", **gateway}))


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "10.1.2.3", "llm.bank.test", "localhost", "::ffff:127.0.0.1"])
def test_plain_http_on_a_network_address_is_refused_unless_forced(tmp_path: Path, bind: str) -> None:
    settings_file = tmp_path / "settings.toml"
    settings_file.write_text(f'[gateway]\nbind = "{bind}"\ntls = "off"\n')
    with pytest.raises(SettingsError) as refused:
        load_settings(settings_file, environ={})
    assert "gateway" in str(refused.value) and "in clear" in str(refused.value)
    settings_file.write_text(f'[gateway]\nbind = "{bind}"\ntls = "off"\nallow_plain_http = true\n')
    assert not load_settings(settings_file, environ={}).gateway.https
    settings_file.write_text(f'[gateway]\nbind = "{bind}"\n')
    assert load_settings(settings_file, environ={}).gateway.https  # auto: HTTPS on the network


@pytest.mark.parametrize("bind", ["127.0.0.1", "::1", "127.0.0.2"])
def test_loopback_stays_plain_unless_asked(bind: str) -> None:
    assert not GatewaySettings(bind=bind).https
    assert GatewaySettings(bind=bind, tls="on").https


@pytest.mark.parametrize("name", ["exa mple", "ex\u0430mple.test", "*.bank.test", "a..b", "-lead.test", "x" * 64,
                                  "bank.test\n", "b\u200bank.test", "bank.test/evil"])
def test_certificate_names_are_dns_names_or_addresses(name: str) -> None:
    with pytest.raises(ValueError, match="neither an IP address nor a DNS name|control character"):
        GatewaySettings(names=[name])


def test_the_certificate_and_its_key_go_together() -> None:
    with pytest.raises(ValueError, match="go together"):
        GatewaySettings(certificate="/etc/pki/gateway.pem")


def test_the_ca_certifies_the_names_clients_use_and_renews_on_demand(home: Home) -> None:
    settings = network(names=["LLM.bank.test", "10.9.8.7"])
    certificate_file, key_file = tls.gateway_certificate(settings, home)
    first = x509.load_pem_x509_certificate(certificate_file.read_bytes())
    assert names_of(first) == {"localhost", "127.0.0.1", "llm.bank.test", "10.9.8.7"}
    assert os.stat(key_file).st_mode & 0o777 == 0o600
    assert tls.gateway_certificate(settings, home)[0].read_bytes() == certificate_file.read_bytes()  # kept
    tls.gateway_certificate(settings, home, renew=True)
    renewed = x509.load_pem_x509_certificate(certificate_file.read_bytes())
    assert renewed.serial_number != first.serial_number and names_of(renewed) == names_of(first)
    specific = Settings(gateway=GatewaySettings(bind="10.1.2.3"))
    assert "10.1.2.3" in names_of(x509.load_pem_x509_certificate(tls.gateway_certificate(specific, home)[0]
                                                                  .read_bytes()))


def test_only_tls_1_2_and_later_with_modern_ciphers(home: Home) -> None:
    server = tls.server_context(*tls.gateway_certificate(network(), home))
    assert handshake(server, trusting(tls.ca_file(home)), "localhost")  # TLS 1.3
    client = trusting(tls.ca_file(home))
    client.maximum_version = ssl.TLSVersion.TLSv1_2
    client.set_ciphers("ECDHE+AESGCM")
    assert handshake(server, client, "localhost")
    old = trusting(tls.ca_file(home))
    old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_1
    old.set_ciphers("ALL:@SECLEVEL=0")
    with pytest.raises(ssl.SSLError):
        handshake(server, old, "localhost")
    weak = trusting(tls.ca_file(home))
    weak.maximum_version = ssl.TLSVersion.TLSv1_2
    weak.set_ciphers("AES128-SHA:AES256-SHA:AES128-GCM-SHA256:DHE-RSA-AES128-SHA")  # no forward secrecy, or CBC
    with pytest.raises(ssl.SSLError):
        handshake(server, weak, "localhost")


def organisation(tmp_path: Path, **more: object) -> tuple[Settings, Chain]:
    chain = organisation_chain(tmp_path / "pki", ["llm.bank.test", "10.20.30.40"])
    return network(certificate=str(chain.certificate), private_key=str(chain.private_key), **more), chain


def test_the_network_gets_the_organisations_chain_and_local_clients_the_cas(tmp_path: Path, home: Home) -> None:
    settings, chain = organisation(tmp_path)
    served = GatewayTLS(settings, home)
    shown = handshake(served.context, trusting(chain.root), "llm.bank.test")
    assert common_name(shown) == "llm.bank.test"
    assert common_name(handshake(served.context, trusting(chain.root), None)) == "llm.bank.test"  # by address
    local = handshake(served.context, tls.local_trust(home), "localhost")
    assert common_name(local) == "appliance gateway"
    with pytest.raises(ssl.SSLCertVerificationError):  # the CA's certificate names no one else
        handshake(served.context, tls.local_trust(home), "llm.bank.test")


@pytest.mark.parametrize("fault", ["missing", "not_pem", "wrong_key", "expired", "open_key"])
def test_a_bad_organisation_certificate_is_named_at_up(tmp_path: Path, home: Home, fault: str) -> None:
    settings, chain = organisation(tmp_path)
    if fault == "missing":
        chain.certificate.unlink()
    elif fault == "not_pem":
        chain.certificate.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n")
    elif fault == "wrong_key":
        write_key(chain.private_key, ec.generate_private_key(ec.SECP256R1()))
    elif fault == "expired":
        organisation_chain(tmp_path / "pki", ["llm.bank.test"], days=(-30, -1))
    else:
        chain.private_key.chmod(0o644)
    missing = gateway_program(settings, home).missing
    assert missing is not None and missing.startswith("gateway.certificate: ")
    assert str(chain.certificate) in missing or str(chain.private_key) in missing
    expected = {"missing": "is not a file", "not_pem": "", "wrong_key": "", "expired": "valid from",
                "open_key": "readable by others"}[fault]
    assert expected in missing
    assert gateway_program(network(), home).missing is None  # the CA's own: nothing to check


def test_a_replaced_certificate_is_served_from_the_next_handshake_and_a_bad_one_is_not(
        tmp_path: Path, home: Home, caplog: pytest.LogCaptureFixture) -> None:
    settings, chain = organisation(tmp_path)
    served = GatewayTLS(settings, home)
    before = handshake(served.context, trusting(chain.root), "llm.bank.test")
    # Half replaced: a new key beside the old certificate. The old pair goes on serving, logged once.
    fresh = organisation_chain(tmp_path / "next", ["llm.bank.test", "10.20.30.40"])
    chain.private_key.write_bytes(fresh.private_key.read_bytes())
    with caplog.at_level(logging.ERROR, logger="appliance.gateway"):
        served.refresh()
        served.refresh()
    assert [record.message for record in caplog.records].count(caplog.records[0].message) == 1
    assert "goes on serving" in caplog.records[0].message
    assert handshake(served.context, trusting(chain.root), "llm.bank.test").serial_number == before.serial_number
    chain.certificate.write_bytes(fresh.certificate.read_bytes())  # the new pair, whole
    served.refresh()
    after = handshake(served.context, trusting(fresh.root), "llm.bank.test")
    assert after.serial_number != before.serial_number
    # `appliance tls renew` replaces the CA's certificate: local clients get the new one.
    local = handshake(served.context, tls.local_trust(home), "localhost")
    tls.gateway_certificate(settings, home, renew=True)
    served.refresh()
    assert handshake(served.context, tls.local_trust(home), "localhost").serial_number != local.serial_number


def test_a_certificate_near_its_end_is_renewed_by_the_running_gateway(home: Home,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    settings = network()
    served = GatewayTLS(settings, home)
    first = handshake(served.context, tls.local_trust(home), "localhost")
    monkeypatch.setattr(tls, "RENEW_BEFORE", tls.RENEW_BEFORE + datetime.timedelta(days=tls.SERVER_DAYS))
    served.refresh()
    assert handshake(served.context, tls.local_trust(home), "localhost").serial_number != first.serial_number


def test_local_clients_reach_the_gateway_over_https_as_localhost(home: Home) -> None:
    assert gateway_url(Settings()) == "http://127.0.0.1:8080"
    assert gateway_url(network(port=8443)) == "https://127.0.0.1:8443"
    assert gateway_url(Settings(gateway=GatewaySettings(bind="::", port=8443))) == "https://127.0.0.1:8443"
    assert gateway_url(Settings(gateway=GatewaySettings(bind="fd00::5"))) == "https://[fd00::5]:8080"
    assert "transport" not in client_options(Settings(), home)
    tls.ensure_ca(home)
    assert client_options(network(), home)["transport"] is not None


def test_a_new_pair_replaces_the_old_whole_even_of_another_key_type(tmp_path: Path, home: Home) -> None:
    """OpenSSL keeps a certificate per key type in one context: the old RSA certificate must not
    go on being shown to clients that ask for RSA after an EC pair replaced it."""
    chain = organisation_chain(tmp_path / "pki", ["llm.bank.test"], rsa_leaf=True)
    settings = network(certificate=str(chain.certificate), private_key=str(chain.private_key))
    served = GatewayTLS(settings, home)
    rsa_only = trusting(chain.root)
    rsa_only.maximum_version = ssl.TLSVersion.TLSv1_2
    rsa_only.set_ciphers("ECDHE+aRSA+AESGCM")
    before = handshake(served.context, rsa_only, "llm.bank.test")
    fresh = organisation_chain(tmp_path / "next", ["llm.bank.test"])  # EC
    chain.private_key.write_bytes(fresh.private_key.read_bytes())
    chain.certificate.write_bytes(fresh.certificate.read_bytes())
    served.refresh()
    with pytest.raises(ssl.SSLError):  # no RSA certificate any more: not the old one
        handshake(served.context, rsa_only, "llm.bank.test")
    assert handshake(served.context, trusting(fresh.root), "llm.bank.test").serial_number != before.serial_number


@pytest.mark.parametrize("fault", ["open_key", "expired"])
def test_a_replacement_up_would_refuse_is_not_served(tmp_path: Path, home: Home, fault: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    settings, chain = organisation(tmp_path)
    served = GatewayTLS(settings, home)
    before = handshake(served.context, trusting(chain.root), "llm.bank.test")
    fresh = organisation_chain(tmp_path / "next", ["llm.bank.test"], days=(-30, -1) if fault == "expired" else (-1, 90))
    chain.certificate.write_bytes(fresh.certificate.read_bytes())
    chain.private_key.write_bytes(fresh.private_key.read_bytes())
    if fault == "open_key":
        chain.private_key.chmod(0o644)
    with caplog.at_level(logging.ERROR, logger="appliance.gateway"):
        served.refresh()
    assert handshake(served.context, trusting(chain.root), "llm.bank.test").serial_number == before.serial_number
    [said] = [record.message for record in caplog.records]
    assert str(chain.certificate) in said or str(chain.private_key) in said  # the files, not private copies


def test_a_tls_handshake_has_the_header_deadline(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection that opens and never completes its handshake is closed at the header deadline
    (before its protocol, and so the connection cap, ever sees it)."""
    from serve import listener

    monkeypatch.setattr(listener.GuardedHttpToolsProtocol, "header_timeout_s", 0.5)
    context = tls.server_context(*tls.gateway_certificate(network(), home))

    async def silent_client_is_dropped() -> float:
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0, ssl=context)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
        writer.close()
        server.close()
        return time.monotonic() - started

    loop = listener.guarded_loop()
    try:
        assert loop.run_until_complete(silent_client_is_dropped()) < 5
    finally:
        loop.close()


def test_server_certificates_of_a_ca_made_anew_are_issued_again(home: Home) -> None:
    first = x509.load_pem_x509_certificate(tls.gateway_certificate(network(), home)[0].read_bytes())
    tls.ca_file(home).unlink()
    (home.secrets / tls.CA_KEY).unlink()
    tls.ensure_ca(home)  # same name, another key
    again = x509.load_pem_x509_certificate(tls.gateway_certificate(network(), home)[0].read_bytes())
    assert again.serial_number != first.serial_number
    assert handshake(tls.server_context(*tls.gateway_certificate(network(), home)), tls.local_trust(home),
                     "localhost")


@pytest.mark.parametrize("bind", ["*.corp.example", "*", "llm.bank.test"])
def test_a_host_name_to_bind_is_not_put_in_the_certificate(home: Home, bind: str) -> None:
    issued = x509.load_pem_x509_certificate(
        tls.gateway_certificate(Settings(gateway=GatewaySettings(bind=bind)), home)[0].read_bytes())
    assert names_of(issued) == {"localhost", "127.0.0.1"}


def test_a_name_that_is_not_ascii_is_reported_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    from serve.https import _QuietUndecodableNames

    hook = _QuietUndecodableNames()
    passed_on: list[object] = []
    hook.previous = passed_on.append
    bad = types.SimpleNamespace(exc_value=UnicodeDecodeError("ascii", b"\xff", 0, 1, "bad"))
    with caplog.at_level(logging.WARNING, logger="appliance.gateway"):
        for _ in range(100):
            hook(bad)
    assert len(caplog.records) == 1 and passed_on == []
    other = types.SimpleNamespace(exc_value=ValueError("x"))
    hook(other)
    assert passed_on == [other]
