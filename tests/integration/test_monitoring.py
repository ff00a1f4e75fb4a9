"""Prometheus and Alertmanager on the session appliance: both supervised and listed by `status`,
on loopback behind the appliance's password; Prometheus scrapes the gateway and both servers and
holds the gateway's state metrics; /admin/charts reads the dashboard's key series from it; an
alert goes from the shipped rules through Alertmanager to the webhook of the settings, and
`appliance alerts` lists it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from appliance.alerts import monitoring_auth
from appliance.charts import CHARTS
from appliance.secrets import secret
from appliance.tls import local_trust
from installer.realm import BOOTSTRAP_SECRET
from tests.integration.conftest import Running
from tests.integration.realm import Realm
from tests.support.webhook import webhook_receiver


def until(check: Callable[[], Any], what: str | Callable[[], str], timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what if isinstance(what, str) else what()}"
        time.sleep(0.5)
    return found


def prometheus_query(running: Running, urls: dict[str, str], expression: str) -> list[dict[str, Any]]:
    """An instant query's result from the appliance's Prometheus, with its password."""
    answer = httpx.get(f"{urls['prometheus']}/api/v1/query", params={"query": expression},
                       auth=monitoring_auth(running.appliance.home), verify=local_trust(running.appliance.home),
                       timeout=10)
    answer.raise_for_status()
    return list(answer.json()["data"]["result"])


@pytest.fixture(scope="module")
def urls(running: Running) -> dict[str, str]:
    status = json.loads(running.appliance.run("status", "--json", timeout=60).stdout)
    programs = {p["name"]: p for p in status["programs"]}
    for name in ("prometheus", "alertmanager"):
        assert programs[name]["state"] == "RUNNING" and programs[name]["healthy"], programs[name]
    return {"prometheus": programs["prometheus"]["urls"]["prometheus"],
            "alertmanager": programs["alertmanager"]["urls"]["alertmanager"]}


@pytest.fixture(scope="module")
def webhook(running: Running) -> Iterator[list[dict[str, Any]]]:
    """What Alertmanager posts to the session's webhook URL, as it arrives."""
    with webhook_receiver(running.appliance.env["APPLIANCE_MONITORING__WEBHOOK_URL"]) as received:
        yield received


def test_both_servers_listen_on_loopback_over_https_behind_the_appliances_password(running: Running,
                                                                                   urls: dict[str, str]) -> None:
    home = running.appliance.home
    auth, trust = monitoring_auth(home), local_trust(home)
    for url in urls.values():
        assert urlsplit(url).hostname == "127.0.0.1" and url.startswith("https://")
        assert httpx.get(f"{url}/-/ready", verify=trust, timeout=10).status_code == 401, "no password: refused"
        assert httpx.get(f"{url}/-/ready", auth=(auth[0], "guessed"), verify=trust, timeout=10).status_code == 401
        assert httpx.get(f"{url}/-/ready", auth=auth, verify=trust, timeout=10).status_code == 200
    # The engines' relay at the gateway reaches every engine: the monitoring password only.
    gateway = f"http://127.0.0.1:{running.appliance.port('APPLIANCE_GATEWAY__PORT')}/metrics/engines"
    assert httpx.get(gateway, timeout=30).status_code == 401
    assert httpx.get(gateway, auth=(auth[0], "guessed"), timeout=30).status_code == 401
    relayed = httpx.get(gateway, auth=auth, timeout=30)
    assert relayed.status_code == 200 and 'appliance_engine_scrape_up{pool="main",replica="main"' in relayed.text
    assert "vllm:num_requests_waiting{" in relayed.text and "gateway_" not in relayed.text


def test_prometheus_scrapes_the_gateway_and_holds_its_state(running: Running, urls: dict[str, str]) -> None:
    auth, trust = monitoring_auth(running.appliance.home), local_trust(running.appliance.home)

    def query(expression: str) -> list[dict[str, Any]]:
        return prometheus_query(running, urls, expression)

    seen: dict[str, str] = {}

    def targets_up() -> bool:
        answer = httpx.get(f"{urls['prometheus']}/api/v1/targets", auth=auth, verify=trust, timeout=10).json()
        seen.update({t["labels"]["job"]: f"{t['health']} {t['lastError']}" for t in answer["data"]["activeTargets"]})
        return {job: state.split()[0] for job, state in seen.items()} == {
            "gateway": "up", "engines": "up", "prometheus": "up", "alertmanager": "up"}

    until(targets_up, lambda: f"every target scraped: {seen}")
    [writable] = until(lambda: query("gateway_audit_writable"), "the audit writer's state")
    assert writable["value"][1] == "1"
    [ca] = until(lambda: query('appliance_certificate_expiry_timestamp_seconds{certificate="ca"}'), "the CA's end")
    assert float(ca["value"][1]) > time.time() + 300 * 86400
    [free] = query('appliance_disk_free_bytes{volume="state"}')
    assert float(free["value"][1]) > 0
    [waiting, *_] = until(lambda: query('vllm:num_requests_waiting{pool="main"}'), "an engine's own metric")
    assert waiting["metric"]["replica"] == "main" and waiting["metric"]["job"] == "engines"
    labels = httpx.get(f"{urls['prometheus']}/api/v1/labels", auth=auth, verify=trust, timeout=10).json()["data"]
    assert not {"user", "username", "subject", "prompt", "key"} & set(labels), labels


def test_prometheus_holds_the_queues_and_each_gpu_as_nvml_reports_it(running: Running, urls: dict[str, str]) -> None:
    """The session reads its GPUs through a stand-in NVML library (tests/support/fake_nvml.c):
    its figures reach Prometheus as they are, and a figure it does not report has no series."""

    def query(expression: str) -> list[dict[str, Any]]:
        return prometheus_query(running, urls, expression)

    [up] = until(lambda: query('appliance_gpu_nvml_up{job="gateway"}'), "NVML's state")
    assert up["value"][1] == "1"
    used = {r["metric"]["gpu"]: float(r["value"][1]) for r in query('appliance_gpu_memory_used_bytes{job="gateway"}')}
    assert used == {"0": 144e9, "1": 30e9}
    assert [r["metric"]["gpu"] for r in query('appliance_gpu_power_watts{job="gateway"}')] == ["0"]
    [errors] = query('appliance_gpu_ecc_errors_total{job="gateway", gpu="1", kind="uncorrected"}')
    assert errors["value"][1] == "2"
    queues = {r["metric"]["queue"] for r in query('appliance_queue_readable{job="gateway"} == 1')}
    assert queues == {"finetune_jobs", "rl_runs", "rl_exports", "batch_requests", "batch_validations", "rl_executions"}
    assert query('appliance_queue_oldest_waiting_seconds{job="gateway", queue="finetune_jobs"}')


def test_admin_charts_are_the_key_series_prometheus_holds(running: Running, urls: dict[str, str]) -> None:
    """The dashboard's charts (GET /admin/charts): every named series, a point a step over the
    window; with traffic the requests series shows it (Prometheus scrapes every 2 s here; a rate
    needs the counter seen rising), and the engines' series comes through the relay."""
    realm = Realm(running)
    admin = {"Authorization": f"Bearer {realm.admin_token()}"}
    shown: list[dict[str, Any]] = []

    def charted() -> bool:
        assert httpx.get(f"{realm.gateway}/v1/models", headers=admin, timeout=30).status_code == 200  # traffic
        answer = httpx.get(f"{realm.gateway}/admin/charts", headers=admin, timeout=60)
        assert answer.status_code == 200, answer.text
        shown[:] = answer.json()
        points = {series["name"]: [p for p in series["points"] if p is not None] for series in shown}
        return any(p > 0 for p in points["requests"]) and bool(points["engine_waiting"])

    until(charted, lambda: f"requests/s above 0 and engine waiting sampled: {shown}")
    assert [(s["name"], s["label"], s["unit"]) for s in shown] == [(c.name, c.label, c.unit) for c in CHARTS]
    assert all(len(s["points"]) == 61 and s["step_s"] == 15 for s in shown), "15 minutes, a point every 15 s"
    refused = httpx.get(f"{realm.gateway}/admin/charts", params={"minutes": 600, "step_s": 1}, headers=admin,
                        timeout=60)
    assert refused.status_code == 400 and "at most 241" in refused.json()["error"]["message"]


def test_an_alert_reaches_the_webhook_and_appliance_alerts(running: Running, urls: dict[str, str],
                                                           webhook: list[dict[str, Any]]) -> None:
    """The Watchdog rule always fires: it crosses the whole path, rules to receiver. Alertmanager
    retries a receiver that was not listening at its next group interval (a minute)."""
    def watchdog_posted() -> bool:
        return any(alert["labels"]["alertname"] == "Watchdog" and post["status"] == "firing"
                   for post in webhook for alert in post["alerts"])

    until(watchdog_posted, "the Watchdog alert at the webhook", timeout_s=180)
    cli = running.appliance
    login = cli.run("token", "--user", "admin", "--password-stdin",
                    stdin=secret(cli.home, BOOTSTRAP_SECRET) + "\n", timeout=60)
    assert login.returncode == 0, login.stderr
    listed = cli.run("alerts", "--json", timeout=60)
    assert listed.returncode == 0, listed.stderr
    watchdog = [a for a in json.loads(listed.stdout) if a["name"] == "Watchdog"]
    assert watchdog and watchdog[0]["severity"] == "none" and "pipeline" in watchdog[0]["summary"]
    table = cli.run("alerts", timeout=60)
    # The heartbeat is never counted as an alert: the table's command says it is ok, as status does.
    assert table.returncode == 0 and "heartbeat ok" in table.stdout, table.stdout + table.stderr
