"""The appliance's own certificate authority, and whom each client trusts for Keycloak.

The embedded Keycloak listens only on TLS, with a certificate this CA issued for loopback. The
gateway, CLI, TUI and installer verify it against the CA, so they take Keycloak's signing keys only
from Keycloak and send the gateway's client secret or a password to no other listener: a local
process that takes Keycloak's port while it restarts cannot complete the handshake. The CA's key
stays in `secrets/` (0600); its certificate, `tls/ca.pem`, is public.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from appliance.durable import replace_file
from appliance.errors import StateError
from appliance.home import Home
from appliance.settings import Settings

CA_KEY = "tls-ca.key"
CA_DAYS = 3650
SERVER_DAYS = 397
# A server certificate this close to its end is reissued at the next start.
RENEW_BEFORE = datetime.timedelta(days=30)


def tls_dir(home: Home) -> Path:
    return home.root / "tls"


def ca_file(home: Home) -> Path:
    """The CA certificate clients trust for the embedded Keycloak."""
    return tls_dir(home) / "ca.pem"


def server_files(home: Home, name: str) -> tuple[Path, Path]:
    """(certificate chain, private key) of the server called `name`."""
    return tls_dir(home) / f"{name}.pem", home.secrets / f"tls-{name}.key"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    if path.stat().st_mode & 0o077:
        raise StateError(f"private key {path} is readable by others", hint=f"chmod 600 {path}")
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise StateError(f"{path} is not an EC private key")
    return key


def ensure_ca(home: Home) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA (made once: an EC P-256 key and a self-signed certificate for ten years)."""
    cert_path, key_path = ca_file(home), home.secrets / CA_KEY
    if cert_path.exists() and key_path.exists():
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), _load_key(key_path)
    if cert_path.exists() != key_path.exists():
        present = cert_path if cert_path.exists() else key_path
        raise StateError(f"{present} exists without its pair; the appliance's CA is incomplete",
                         hint=f"remove {present} to have a new CA made (clients must then trust the new ca.pem)")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "appliance local CA")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    tls_dir(home).mkdir(mode=0o755, exist_ok=True)
    replace_file(key_path, _pem_key(key))
    replace_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return cert, key


def _current(cert_path: Path, key_path: Path, ca: x509.Certificate, names: list[x509.GeneralName]) -> bool:
    """Whether the server certificate exists, chains to this CA, names exactly `names` and is
    not near its end."""
    if not (cert_path.exists() and key_path.exists()):
        return False
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return (cert.issuer == ca.subject and cert.not_valid_after_utc - RENEW_BEFORE > _now()
            and set(sans) == set(names))


def certificate_sha256(certificate: x509.Certificate) -> str:
    """SHA-256 of a certificate (DER): what a joining worker pins of its head's CA."""
    return hashlib.sha256(certificate.public_bytes(serialization.Encoding.DER)).hexdigest()


def ca_sha256(home: Home) -> str:
    """The fingerprint of this appliance's CA (`certificate_sha256`)."""
    return certificate_sha256(ensure_ca(home)[0])


def ensure_server_certificate(home: Home, name: str, addresses: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A server certificate for `name` from the CA, for loopback and `addresses` (issued again
    near its end, or when the addresses change)."""
    ca, ca_key = ensure_ca(home)
    cert_path, key_path = server_files(home, name)
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    names += [x509.IPAddress(ipaddress.ip_address(address)) for address in addresses]
    if _current(cert_path, key_path, ca, names):
        return cert_path, key_path
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"appliance {name}")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=SERVER_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    replace_file(key_path, _pem_key(key))
    replace_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return cert_path, key_path


def keycloak_trust(settings: Settings, home: Home) -> str | bool:
    """What verifies Keycloak's certificate (python-keycloak's and requests' `verify`): the
    appliance's CA for the embedded one; the configured CA file, else the system's, for an external one."""
    keycloak = settings.keycloak
    if keycloak.mode == "external":
        if keycloak.ca_file and not Path(keycloak.ca_file).is_file():
            raise StateError(f"keycloak.ca_file: {keycloak.ca_file} is not a file")
        return keycloak.ca_file or True
    path = ca_file(home)
    if not path.is_file():
        raise StateError(f"the appliance's CA {path} does not exist yet",
                         hint="`appliance up` makes it when it first starts Keycloak")
    return str(path)


def keycloak_ssl(settings: Settings, home: Home) -> ssl.SSLContext:
    """An SSL context (httpx's `verify`) that trusts only what `keycloak_trust` names."""
    trust = keycloak_trust(settings, home)
    return ssl.create_default_context(cafile=trust) if isinstance(trust, str) else ssl.create_default_context()
