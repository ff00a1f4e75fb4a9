"""The head's cluster program (`python -m serve.cluster`, supervised as `cluster`) for pools
whose plan spans hosts (its supervised-program spec is in serve.programs), which serves the cluster
listener (serve.cluster_app) over HTTPS from the appliance's CA. Workers join with their one-time
token (appliance.hosts), receive their ranks' launch (built by the launcher's own `rank_command`),
pull the weights (serve.cluster_weights), then report their ranks every `cluster.heartbeat_s` to
the controller (serve.cluster_controller), which runs in this process too.
"""

from __future__ import annotations

import uvicorn

from appliance.home import Home
from appliance.settings import load_settings
from appliance.tls import ensure_server_certificate
from serve.cluster_app import create_app
from serve.listener import GuardedHttpToolsProtocol


def main() -> None:
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    cluster = settings.cluster
    if cluster.bind is None:
        raise SystemExit("cluster.bind is not set")
    cert, key = ensure_server_certificate(home, "cluster", (str(cluster.bind),))
    # The gateway's guard: slow or endless header senders and connection floods are cut off.
    GuardedHttpToolsProtocol.header_timeout_s = settings.gateway.header_timeout_s
    GuardedHttpToolsProtocol.max_connections = 256
    uvicorn.run(create_app(settings, home), host=str(cluster.bind), port=cluster.port, ssl_certfile=str(cert),
                ssl_keyfile=str(key), http=GuardedHttpToolsProtocol, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
