"""`appliance status` reads at 80 columns, the width Rich assumes without a terminal (every log):
the default table breaks no word, `--wide` splits no URL however long its lines, and the real
command in an 80-column tmux pane breaks nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from appliance import login
from appliance.commands.lifecycle import gpu_ranges, print_status, short_serves
from appliance.home import Home
from appliance.terminal import duration
from tests.support.appliances import APPLIANCE
from tests.support.terminal import Pane, broken, whole_on_a_line
from tests.support.tokens import ISSUER, admin_token, here

HOME = "/var/lib/appliance"


def program(name: str, **fields: Any) -> dict[str, Any]:
    """One program as appliance.lifecycle.status reports it."""
    return {"name": name, "pool": None, "gpus": [], "state": "RUNNING", "pid": 412345, "uptime_s": 187_000,
            "model": None, "port": None, "socket": None, "healthy": True, "urls": {},
            "log": f"{HOME}/logs/{name}.log", **fields}


def engine(name: str, pool: str, gpus: list[int]) -> dict[str, Any]:
    socket = f"{HOME}/run/engines/{name}.sock"
    return program(name, pool=pool, gpus=gpus, model="Qwen2.5-Coder-32B-Instruct", socket=socket,
                   urls={"openai": f"unix:{socket}"})


REPORT: dict[str, Any] = {
    "home": HOME,
    "supervisord": {"running": True, "pid": 4000, "socket": f"{HOME}/run/supervisor.sock"},
    "programs": [
        program("keycloak", port=8443, urls={"issuer": ISSUER, "admin": "https://127.0.0.1:8443/admin/"}),
        engine("vllm-coder", "coder", [0, 1, 2, 3]),
        engine("vllm-coder_1", "coder", [4, 5, 6, 7]),
        program("gateway", port=8080, urls={"openai": "http://127.0.0.1:8080/v1",
                                            "admin": "http://127.0.0.1:8080/admin",
                                            "metrics": "http://127.0.0.1:8080/metrics", "issuer": ISSUER}),
        program("cluster", urls={"cluster": "https://10.20.30.40:7443"}),
        program("finetune-worker", state="BACKOFF", pid=0, uptime_s=0, healthy=False),
        program("batch-worker", uptime_s=42),
    ],
    "cluster": [{"pool": "big", "epoch": 3, "ready": False, "why": "waiting for node 1 to report its rank",
                 "ranks": [{"host": "head", "node": 0, "running": True, "pid": 5555, "epoch": 3,
                            "seen_s_ago": None, "host_state": "head"},
                           {"host": "gpu-node-17.example.internal", "node": 1, "running": False, "pid": 0,
                            "epoch": 3, "seen_s_ago": 12.34, "host_state": "not added"}]}],
}


def rendered(wide: bool, width: int = 80) -> list[str]:
    text = StringIO()
    print_status(Console(width=width, file=text), REPORT, wide=wide)
    return text.getvalue().splitlines()


def compact_words() -> set[str]:
    words = {"program", "state", "health", "uptime", "gpus", "serves", "model", "node", "host", "rank", "pid",
             "epoch", "0-3", "4-7", ":8443", ":8080", ":7443", "socket", "2d03h", "42s", "0s", "ok", "no",
             "gpu-node-17.example.internal", "12.3", f"{HOME}/logs"}
    for p in REPORT["programs"]:
        words |= {p["name"], p["state"], *(p["model"] or "").split()}
    words |= set(REPORT["cluster"][0]["why"].split())
    return words


def test_the_default_table_breaks_no_word_at_80_columns() -> None:
    lines = rendered(wide=False)
    assert max(map(len, lines)) <= 80, lines
    assert not broken(compact_words(), lines), "\n".join(lines)
    assert not any("://" in line for line in lines[:len(REPORT["programs"]) + 1])  # no URL in the table
    assert lines[0].split() == ["program", "state", "health", "uptime", "gpus", "serves", "model"]


def test_wide_shows_every_url_whole_however_long_the_lines() -> None:
    lines = rendered(wide=True)
    urls = {url for p in REPORT["programs"] for url in p["urls"].values()}
    assert not broken(urls | {"412345", "coder", "Qwen2.5-Coder-32B-Instruct"}, lines), "\n".join(lines)
    assert max(map(len, lines)) > 80  # the engines' socket URLs do not fit: the lines grow instead
    assert lines[0].split() == ["program", "pool", "state", "health", "pid", "uptime", "gpus", "model", "serves"]


def test_a_narrow_terminal_shows_a_block_of_lines_a_program_with_every_value_whole() -> None:
    """Too narrow for the table: never a value shortened (it was, with an ellipsis), but each
    program as `header value` lines."""
    lines = rendered(wide=False, width=60)
    assert max(map(len, lines)) <= 60 and not any("…" in line for line in lines)
    for p in REPORT["programs"]:
        assert f"program  {p['name']}" in lines
        assert f"model    {p['model'] or '-'}" in lines
    # The last heartbeat (text) is what gives way at this width, with a note saying so.
    assert not broken(compact_words() - {"12.3"}, lines), "\n".join(lines)
    assert "left out at this width: last heartbeat" in " ".join(" ".join(lines).split())


@pytest.mark.parametrize(("seconds", "said"), [
    (0, "0s"), (42.9, "42s"), (60, "1m00s"), (303, "5m03s"), (3600, "1h00m"), (7500, "2h05m"),
    (86400, "1d00h"), (187_000, "2d03h"), (40 * 86400, "40d00h"),
])
def test_durations_are_one_short_word(seconds: float, said: str) -> None:
    assert duration(seconds) == said


@pytest.mark.parametrize(("gpus", "said"), [
    ([], "-"), ([3], "3"), ([0, 1, 2, 3], "0-3"), ([6, 0, 1, 2, 3], "0-3,6"), ([0, 2, 4, 6], "0,2,4,6"),
])
def test_gpu_ranges(gpus: list[int], said: str) -> None:
    assert gpu_ranges(gpus) == said


def test_serves_is_the_port_the_socket_or_the_urls_ports() -> None:
    assert short_serves(program("gateway", port=8080, urls={"issuer": ISSUER})) == ":8080"  # not keycloak's
    assert short_serves(engine("vllm-a", "a", [])) == "socket"
    assert short_serves(program("cluster", urls={"cluster": "https://10.0.0.5:7443"})) == ":7443"
    assert short_serves(program("batch-worker")) == "-"


# --- the real command in an 80-column terminal ---------------------------------------------


@pytest.fixture
def pane(home: Home) -> Iterator[Pane]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    # The appliance set up but not running; no COLUMNS, so the width is the terminal's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_") and k not in ("COLUMNS", "LINES")}
    env.update({"APPLIANCE_HOME": str(home.root), "TERM": "xterm-256color"})
    opened = Pane(env)
    try:
        yield opened
    finally:
        opened.close()


@pytest.mark.integration  # a tmux pane running the installed command
def test_status_whoami_and_their_help_in_an_80_column_terminal(pane: Pane, home: Home) -> None:
    login.save(here(home), admin_token(roles=("admin", "auditor")))
    screen = pane.run(f"{APPLIANCE} status", f"{APPLIANCE} status --json", f"{APPLIANCE} whoami",
                      f"{APPLIANCE} status --help")
    text = "\n".join(screen)
    assert whole_on_a_line("down (supervisord is not running)", screen), text
    start = next(i for i, line in enumerate(screen) if line.startswith("{"))
    end = next(i for i, line in enumerate(screen) if line.startswith("}"))
    assert json.loads("\n".join(screen[start:end + 1]))["supervisord"]["running"] is False
    cache = str(here(home).token_cache)
    assert not broken({"admin", "admin, auditor", "appliance-cli", ISSUER, cache}, screen), text
    help_words = {"--wide", "--json", "state,", "health,", "uptime,", "GPUs,", "model", "serves.", "`serves`",
                  "(`:8080`)", "`socket`", "pool,", "pid", "URLs,"}
    assert not broken(help_words, screen), text
    assert "port)" not in text  # the help names the table's columns, not a `port` column
    # Longer lines are only those of a long value the terminal wrapped, never cut: the state directory's paths
    # and the login cache's (in the user's configuration directory).
    assert not [line for line in screen if len(line) > 80 and str(home.root) not in line and cache not in line], text


@pytest.mark.integration  # runs the installed command
def test_status_json_of_a_stopped_appliance(home: Home) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}, "APPLIANCE_HOME": str(home.root)}
    result = subprocess.run([APPLIANCE, "status", "--json"], env=env, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["programs"] == [] and report["home"] == str(home.root)
    assert Path(report["supervisord"]["socket"]).parent == home.run


def test_status_names_the_alerts_that_need_someone() -> None:
    firing = [{"name": "Watchdog", "severity": "none"}, {"name": "DiskNearFull", "severity": "page"},
              {"name": "KVCacheNearFull", "severity": "ticket"}]
    for alerts, line in [({"firing": firing, "error": None}, "alerts: 2 firing: DiskNearFull (page), KVCacheNearFull "
                          "(ticket); heartbeat ok"),
                         ({"firing": firing[:1], "error": None}, "alerts: none firing; heartbeat ok"),
                         ({"firing": [], "error": None}, "alerts: none firing"),
                         ({"firing": [], "error": "Alertmanager at http://127.0.0.1:9093 did not list its alerts: "
                                                  "[b]boom"}, "alerts: unknown (Alertmanager at http://127.0.0.1:9093 "
                                                              "did not list its alerts: [b]boom)")]:
        text = StringIO()
        print_status(Console(width=200, file=text), {**REPORT, "alerts": alerts})
        assert line in text.getvalue().splitlines(), text.getvalue()
    assert not any(line.startswith("alerts:") for line in rendered(wide=False)), "no Alertmanager: no line"


def test_up_s_summary_fits_80_columns_and_names_every_network_address_whole() -> None:
    """`up` prints the compact table and then where the appliance is reached, an address a line
    (it printed the wide table: 128 columns)."""
    from appliance.commands.lifecycle import print_endpoints

    text = StringIO()
    console = Console(width=80, file=text)
    print_status(console, REPORT)
    print_endpoints(console, REPORT["programs"])
    lines = text.getvalue().splitlines()
    urls = {url for p in REPORT["programs"] for url in p["urls"].values() if not url.startswith("unix:")}
    assert not broken(urls, lines), "\n".join(lines)
    assert all(len(line) <= 80 or any(url in line for url in urls) for line in lines), "\n".join(lines)
    assert "  gateway openai http://127.0.0.1:8080/v1" in lines and not any("unix:" in line for line in lines)
