"""Audit records an idle terminal UI writes a minute, screen by screen: every admin read recorded
(as before, `audit.count_repeated_reads = false`) against repeated reads counted (the default), on
an appliance of its own (embedded Keycloak, the demo model's engine, the gateway), started here
and taken down after. For each screen the two settings take turns (the gateway restarted with the
other one), the order alternating from screen to screen; `appliance tui` runs in tmux at 80x24
and stays on the screen for WINDOW_S. Monitoring reads are summarised over 60 s here, so a
window sees the interval's summary record too.

    .venv/bin/python -m bench.tui_audit_rate

Writes bench/results/tui_audit_rate.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from appliance.home import Home
from appliance.secrets import secret
from audit.reader import read_records
from bench.own_appliance import APPLIANCE, cli, own_appliance
from installer.realm import BOOTSTRAP_SECRET

SUPERVISORCTL = str(Path(sys.executable).with_name("supervisorctl"))
RESULTS = Path(__file__).parent / "results" / "tui_audit_rate.json"
SCREENS = {"d": "dashboard", "m": "models", "j": "jobs", "e": "rl", "u": "users", "k": "keys", "a": "audit"}
WINDOW_S = 60.0
SETTLE_S = 5.0  # the screen's first load, before the window opens
MODES = {"every read recorded (before)": "false", "repeated reads counted (now)": "true"}


def set_mode(home: Home, count_repeated_reads: str) -> None:
    """The gateway restarted with `audit.count_repeated_reads` set as asked (its settings file)."""
    home.settings_file.write_text(f"[audit]\ncount_repeated_reads = {count_repeated_reads}\n"
                                  "monitoring_interval_s = 60\n")
    subprocess.run([SUPERVISORCTL, "-c", str(home.run / "supervisord.conf"), "restart", "gateway"], check=True,
                   capture_output=True)
    time.sleep(3)


def records_by(home: Home, user: str) -> int:
    return sum(1 for record in read_records(home.audit) if record.get("username") == user)


def idle_screen(env: dict[str, str], home: Home, key: str) -> int:
    """Records the TUI writes while it shows screen `key` for WINDOW_S."""
    session = f"bench-tui-{os.getpid()}"
    environment = [arg for name, value in env.items() if name.startswith(("APPLIANCE_", "PATH"))
                   for arg in ("-e", f"{name}={value}")]
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24", *environment,
                    APPLIANCE, "tui"], check=True)
    try:
        time.sleep(SETTLE_S)
        subprocess.run(["tmux", "send-keys", "-t", session, key], check=True)
        time.sleep(SETTLE_S)
        before = records_by(home, "admin")
        time.sleep(WINDOW_S)
        return records_by(home, "admin") - before
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def main() -> None:
    ports = {"APPLIANCE_GATEWAY__PORT": "18580", "APPLIANCE_KEYCLOAK__PORT": "18590",
             "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": "18591"}
    per_minute: dict[str, dict[str, float]] = {name: {} for name in SCREENS.values()}
    with own_appliance("tar-", ports) as (home, env):
        cli(env, "up")
        cli(env, "token", "--user", "admin", "--password-stdin", stdin=secret(home, BOOTSTRAP_SECRET) + "\n")
        for turn, (key, screen) in enumerate(SCREENS.items()):
            modes = list(MODES.items())
            for mode, value in modes if turn % 2 == 0 else reversed(modes):
                set_mode(home, value)
                per_minute[screen][mode] = round(idle_screen(env, home, key) * 60 / WINDOW_S, 1)
                print(f"{screen:10} {mode:32} {per_minute[screen][mode]:5.1f} records/min", flush=True)
    totals = {mode: round(sum(screen[mode] for screen in per_minute.values()), 1) for mode in MODES}
    result: dict[str, Any] = {
        "bench": "tui_audit_rate", "window_s": WINDOW_S, "monitoring_interval_s": 60,
        "records_per_minute": per_minute, "all_screens": totals,
        "host": f"{os.cpu_count()} cores", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(totals))


if __name__ == "__main__":
    main()
