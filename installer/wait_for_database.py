"""Start a program once the supervised PostgreSQL accepts connections: Keycloak gives up at once
when its database does not answer, and `up` counts a program restarted during its start as a
failed start. `python -m installer.wait_for_database PORT TIMEOUT_S -- COMMAND...`"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from installer.postgres import wait_ready


def main(argv: list[str]) -> None:
    port, timeout_s, separator, *command = argv
    if separator != "--" or not command:
        sys.exit("usage: python -m installer.wait_for_database PORT TIMEOUT_S -- COMMAND...")
    deadline = time.monotonic() + float(timeout_s)
    while subprocess.run(wait_ready(int(port), 2), check=False).returncode != 0:
        if time.monotonic() > deadline:
            sys.exit(f"PostgreSQL on 127.0.0.1:{port} did not accept connections within {timeout_s} s")
        time.sleep(0.5)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
