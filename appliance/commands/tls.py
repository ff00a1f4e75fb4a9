"""`appliance tls ...`: the appliance's CA and the gateway's certificate."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from appliance.commands.common import AsJson, context, print_json

tls_app = typer.Typer(help="The gateway's HTTPS: the CA certificate to give clients, the certificate it shows, "
                      "renewal.", no_args_is_help=True)
out = Console()


@tls_app.command("export-ca")
def export_ca() -> None:
    """Print the appliance's CA certificate (PEM): what clients on other machines trust for the gateway
    and Keycloak when the organisation's certificate is not set."""
    from appliance import tls

    _, home = context()
    tls.ensure_ca(home)
    typer.echo(tls.ca_file(home).read_text(), nl=False)


@tls_app.command("show")
def show(json: AsJson = False) -> None:
    """What the gateway shows the network: whose certificate, the names in it, until when."""
    from cryptography import x509

    from appliance import tls

    settings, home = context()
    gateway = settings.gateway
    view: dict[str, Any] = {"https": gateway.https, "bind": gateway.bind, "port": gateway.port}
    if gateway.https:
        if gateway.certificate:
            path, whose = Path(gateway.certificate), "organisation"
        else:
            path, whose = tls.gateway_certificate(settings, home)[0], "appliance CA"
        leaf = x509.load_pem_x509_certificate(path.read_bytes())
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        view |= {"certificate": str(path), "issued_by": whose, "names": [str(name.value) for name in names],
                 "not_after": leaf.not_valid_after_utc.isoformat(), "sha256": tls.certificate_sha256(leaf),
                 "ca_certificate": str(tls.ca_file(home))}
    if json:
        print_json(view)
        return
    if not gateway.https:
        out.print(f"the gateway serves plain HTTP on {gateway.bind}:{gateway.port} (gateway.tls = {gateway.tls})",
                  markup=False)
        return
    left = datetime.datetime.fromisoformat(view["not_after"]) - datetime.datetime.now(datetime.UTC)
    whose_text = ("the organisation's (gateway.certificate)" if view["issued_by"] == "organisation"
                  else "issued by the appliance's CA")
    out.print(f"https on {gateway.bind}:{gateway.port}, certificate {whose_text}: {view['certificate']}\n"
              f"  names: {', '.join(view['names'])}\n"
              f"  valid until {view['not_after'][:16].replace('T', ' ')} UTC ({left.days} days)\n"
              f"  sha256: {view['sha256']}", markup=False)


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
