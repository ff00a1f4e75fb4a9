"""`appliance tls ...`: the appliance's CA and the gateway's certificate."""

from __future__ import annotations

import datetime
from pathlib import Path

import typer
from rich.console import Console

from appliance.commands.common import context

tls_app = typer.Typer(help="The gateway's HTTPS: the CA certificate to give clients, the certificate it shows, "
                      "renewal.", no_args_is_help=True)
out = Console()


@tls_app.command("ca-cert")
def ca_cert() -> None:
    """Print the appliance's CA certificate (PEM): what clients on other machines trust for the gateway
    and Keycloak when the organisation's certificate is not set."""
    from appliance import tls

    _, home = context()
    tls.ensure_ca(home)
    typer.echo(tls.ca_file(home).read_text(), nl=False)


@tls_app.command("show")
def show() -> None:
    """What the gateway shows the network: whose certificate, the names in it, until when."""
    from cryptography import x509

    from appliance import tls

    settings, home = context()
    gateway = settings.gateway
    if not gateway.https:
        out.print(f"the gateway serves plain HTTP on {gateway.bind}:{gateway.port} (gateway.tls = {gateway.tls})",
                  markup=False)
        return
    if gateway.certificate:
        path, whose = Path(gateway.certificate), "the organisation's (gateway.certificate)"
    else:
        path, whose = tls.gateway_certificate(settings, home)[0], "issued by the appliance's CA"
    leaf = x509.load_pem_x509_certificate(path.read_bytes())
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    left = leaf.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    out.print(f"https on {gateway.bind}:{gateway.port}, certificate {whose}: {path}\n"
              f"  names: {', '.join(str(name.value) for name in names)}\n"
              f"  valid until {leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC ({left.days} days)\n"
              f"  sha256: {tls.certificate_sha256(leaf)}", markup=False)


@tls_app.command("renew")
def renew() -> None:
    """Issue the gateway a new certificate from the appliance's CA now; the running gateway serves it
    from its next connection (it also renews one by itself 30 days before its end)."""
    from appliance import tls

    settings, home = context()
    certificate, _ = tls.gateway_certificate(settings, home, renew=True)
    out.print(f"renewed {certificate}: valid until {tls.expires(certificate):%Y-%m-%d} UTC; a running gateway "
              "serves it within seconds", markup=False)
    if settings.gateway.certificate:
        out.print(f"the network is shown the organisation's certificate ({settings.gateway.certificate}): "
                  "replace that file to renew it; the gateway loads it from its next connection", markup=False)
