"""Where the CLI and the TUI work: this host's appliance, or a remote one.

`appliance token --gateway https://host:port [--ca-file FILE]` makes a remote appliance the current
one for this user (kubectl-style): the gateway's URL, the CA certificate that verifies it and the
realm it publishes (`/.well-known/appliance`) are kept in the user's configuration directory, and
every login and admin call goes to that gateway (Keycloak's login endpoints through it,
serve.identity_proxy). `appliance token --gateway local` goes back to this host's appliance.

Logins are cached per user there too, one file per realm (0600, in a 0700 directory), so an
administrator, a non-root account on the appliance's host and a workstation each keep their own.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import ssl
import stat
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from appliance.durable import replace_file
from appliance.errors import Invalid, Unavailable
from appliance.home import Home
from appliance.settings import Settings

PROFILE = "remote.json"
DISCOVERY_BYTES = 64 * 1024
REALM_PATH = re.compile(r"/realms/[A-Za-z0-9_-]{1,64}")
REMOTE_CA = "remote-ca.pem"


def config_dir() -> Path:
    """This user's configuration directory for the appliance ($XDG_CONFIG_HOME/appliance, else
    ~/.config/appliance), made 0700."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    path = Path(base) / "appliance"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _owned(path)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def _owned(path: Path) -> None:
    """Invalid unless this user owns `path` (not a link): a directory or profile another user
    planted (an XDG_CONFIG_HOME kept across `su`) would send logins where they choose."""
    found = path.lstat()
    if found.st_uid != os.geteuid() or stat.S_ISLNK(found.st_mode):
        raise Invalid(f"{path} belongs to another user (uid {found.st_uid}) or is a link: it is not used",
                      hint="run the CLI with your own configuration directory ($XDG_CONFIG_HOME, ~/.config)")


@dataclass(frozen=True)
class Connection:
    """A gateway and the realm whose tokens it takes: where logins and admin calls go."""

    gateway: str  # base URL
    realm_url: str  # the realm's endpoints (…/realms/NAME), reachable from here
    issuer: str  # the tokens' `iss`
    client_id: str  # the CLI's public client
    remote: bool
    # What verifies the realm's endpoints, and httpx's options for the gateway (base_url and
    # transport or verify): made when a call needs them (this host's CA exists only after `up`).
    keycloak_trust: Callable[[], ssl.SSLContext | bool]
    gateway_options: Callable[[], dict[str, Any]]
    async_gateway_options: Callable[[], dict[str, Any]]

    @property
    def token_cache(self) -> Path:
        """This user's cached login for this realm at this gateway (a gateway that claims another's
        realm gets a cache of its own, never that realm's tokens)."""
        digest = hashlib.sha256(f"{self.gateway}\n{self.issuer}".encode()).hexdigest()[:16]
        return config_dir() / "logins" / f"{digest}.json"


def local(settings: Settings, home: Home) -> Connection:
    """This host's appliance: its gateway and its Keycloak on loopback."""
    from appliance.local_gateway import async_client_options, client_options, gateway_url
    from appliance.tls import keycloak_ssl

    keycloak = settings.keycloak
    return Connection(gateway=gateway_url(settings), realm_url=keycloak.realm_url, issuer=keycloak.issuer,
                      client_id=keycloak.cli_client_id, remote=False,
                      keycloak_trust=lambda: keycloak_ssl(settings, home),
                      gateway_options=lambda: client_options(settings, home),
                      async_gateway_options=lambda: async_client_options(settings, home))


def current(settings_and_home: Callable[[], tuple[Settings, Home]]) -> Connection:
    """The remote appliance this user chose, else this host's (`settings_and_home` is called only then)."""
    profile = config_dir() / PROFILE
    if profile.is_file():
        _owned(profile)
        try:
            return _remote(json.loads(profile.read_text()))
        except (ValueError, KeyError, TypeError) as exc:
            raise Invalid(f"{profile} is not a remote appliance's profile ({type(exc).__name__}: {exc})",
                          hint="log in again: `appliance token --gateway URL`, or `--gateway local`") from exc
    settings, home = settings_and_home()
    return local(settings, home)


def _remote(profile: dict[str, Any]) -> Connection:
    gateway, ca = str(profile["gateway"]), profile.get("ca_file")
    if not REALM_PATH.fullmatch(str(profile["realm_path"])):
        raise ValueError(f"realm_path {str(profile['realm_path'])[:80]!r} is not /realms/NAME")

    def verify() -> ssl.SSLContext | bool:
        return ssl.create_default_context(cafile=str(ca)) if ca else True

    return Connection(gateway=gateway, realm_url=f"{gateway}{profile['realm_path']}", issuer=str(profile["issuer"]),
                      client_id=str(profile["client_id"]), remote=True, keycloak_trust=verify,
                      gateway_options=lambda: {"base_url": gateway, "verify": verify()},
                      async_gateway_options=lambda: {"base_url": gateway, "verify": verify()})


def discover(gateway: str, ca_file: Path | None) -> Connection:
    """The remote appliance at `gateway` (https://HOST[:PORT]), verified with `ca_file` (else the
    system's trust store): what its `/.well-known/appliance` says. Invalid for a URL that is not
    https://HOST[:PORT]; Unavailable when it cannot be reached or does not publish its logins."""
    parsed = urllib.parse.urlsplit(gateway)
    if parsed.scheme != "https" or not parsed.hostname or parsed.path not in ("", "/") or parsed.query:
        raise Invalid(f"--gateway {gateway[:200]!r}: give https://HOST[:PORT] (the gateway's public URL)")
    if ca_file is not None and not ca_file.is_file():
        raise Invalid(f"--ca-file {ca_file}: not a file", hint="`appliance tls export-ca` on the appliance prints it")
    base = f"https://{parsed.netloc}"
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca_file)) if ca_file else True
    try:
        with httpx.stream("GET", f"{base}/.well-known/appliance", verify=verify, timeout=15) as answer:
            answer.raise_for_status()
            body = b""
            for chunk in answer.iter_bytes():
                body += chunk
                if len(body) > DISCOVERY_BYTES:
                    raise ValueError(f"its answer passes {DISCOVERY_BYTES} bytes")
        found = json.loads(body)
        realm_path = str(found["realm_path"])
        profile = {"gateway": base, "issuer": str(found["issuer"]), "realm_path": realm_path,
                   "client_id": str(found["client_id"]), "ca_file": str(ca_file) if ca_file else None}
        published = bool(found.get("published"))
    except (httpx.HTTPError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise Unavailable(f"the gateway at {base} does not say where to log in ({type(exc).__name__}: "
                          f"{str(exc)[:200]})", hint="is it the appliance's gateway, and is --ca-file the CA that "
                          "signed its certificate (`appliance tls export-ca`)?") from exc
    if not published or not REALM_PATH.fullmatch(realm_path):
        raise Unavailable(f"the gateway at {base} does not publish its logins to other machines",
                          hint="set gateway.public_url on the appliance")
    return _remote(profile)


def remember(connection: Connection, ca_file: Path | None) -> None:
    """Make the remote appliance this user's current one (its CA certificate copied beside it)."""
    directory = config_dir()
    kept = None
    if ca_file is not None:
        kept = directory / REMOTE_CA
        replace_file(kept, ca_file.read_bytes(), mode=0o644)
    profile = {"gateway": connection.gateway, "issuer": connection.issuer,
               "realm_path": connection.realm_url[len(connection.gateway):], "client_id": connection.client_id,
               "ca_file": str(kept) if kept else None}
    replace_file(directory / PROFILE, json.dumps(profile, indent=2).encode(), mode=0o600)


def forget() -> bool:
    """Go back to this host's appliance; whether a remote one was current."""
    profile = config_dir() / PROFILE
    existed = profile.is_file()
    profile.unlink(missing_ok=True)
    (config_dir() / REMOTE_CA).unlink(missing_ok=True)
    return existed
