"""An organisation's PKI for tests: a root CA, an intermediate, and a server certificate it
issues for given names (the chain a bank's platform team would hand the appliance)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from appliance.tls import server_context

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


@dataclass(frozen=True)
class Chain:
    root: Path  # the root CA's certificate: what the organisation's clients trust
    certificate: Path  # the server's certificate, then the intermediate's
    private_key: Path  # the server's key, 0600


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _certificate(subject: str, key: PrivateKey, issuer: str, issuer_key: PrivateKey, *, ca: bool,
                 names: list[str] | None = None, days: tuple[int, int] = (-1, 90)) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now + datetime.timedelta(days=days[0]))
               .not_valid_after(now + datetime.timedelta(days=days[1]))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if names:
        sans: list[x509.GeneralName] = []
        for name in names or []:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                sans.append(x509.DNSName(name))
        builder = (builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(*certificates: x509.Certificate) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certificates)


def write_key(path: Path, key: PrivateKey) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))


def organisation_chain(directory: Path, names: list[str], *, days: tuple[int, int] = (-1, 90),
                       tag: str = "", rsa_leaf: bool = False) -> Chain:
    """A root, an intermediate (RSA, as many enterprise CAs still are) and a server certificate
    for `names` (EC, or RSA), written under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    root_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    middle_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    leaf_key: PrivateKey = (rsa.generate_private_key(public_exponent=65537, key_size=2048) if rsa_leaf
                            else ec.generate_private_key(ec.SECP256R1()))
    root = _certificate("Bank Root CA", root_key, "Bank Root CA", root_key, ca=True, days=(-10, 3650))
    middle = _certificate("Bank Issuing CA", middle_key, "Bank Root CA", root_key, ca=True, days=(-10, 1000))
    leaf = _certificate(names[0], leaf_key, "Bank Issuing CA", middle_key, ca=False, names=names, days=days)
    chain = Chain(directory / f"root{tag}.pem", directory / f"gateway{tag}.pem", directory / f"gateway{tag}.key")
    chain.root.write_bytes(_pem(root))
    chain.certificate.write_bytes(_pem(leaf, middle))
    write_key(chain.private_key, leaf_key)
    return chain


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, server_hostname: str | None) -> x509.Certificate:
    """A TLS handshake in memory; the certificate the server showed (ssl.SSLError if it failed)."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    near = client.wrap_bio(to_client, to_server, server_hostname=server_hostname)
    from_client, from_server = ssl.MemoryBIO(), ssl.MemoryBIO()
    far = server.wrap_bio(from_client, from_server, server_side=True)
    done = {id(near): False, id(far): False}
    for _ in range(20):
        for end in (near, far):
            if not done[id(end)]:
                try:
                    end.do_handshake()
                    done[id(end)] = True
                except ssl.SSLWantReadError:
                    pass
        from_client.write(to_server.read())
        to_client.write(from_server.read())
        if all(done.values()):
            break
    der = near.getpeercert(binary_form=True)
    assert der is not None, "no handshake"
    return x509.load_der_x509_certificate(der)


def serve_tls(handler: type[BaseHTTPRequestHandler], certificate: Path, key: Path) -> HTTPServer:
    """`handler` served over HTTPS on a loopback port of its own, in a thread (a stand-in for one of
    the appliance's loopback servers: Prometheus, Alertmanager)."""
    server = HTTPServer(("127.0.0.1", 0), handler)
    server.socket = server_context(certificate, key).wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
