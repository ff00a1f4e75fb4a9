"""`appliance settings show KEY`, `set KEY VALUE` and `apply`: values shown masked, one setting
written with the rest of the file kept (refused whole when invalid), and the restarts `apply`
plans and makes, through a supervisord that only records what it is asked."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from appliance import lifecycle, live_settings
from appliance.commands.settings import settings_app
from appliance.errors import Conflict, Invalid, SettingsError, StartError
from appliance.home import HOME_ENV, Home
from appliance.programs import Program
from appliance.settings import load_settings
from appliance.settings.root import MASK, Settings
from appliance.settings_changes import apply, changed_keys, plan, set_value, show
from appliance.supervisor import ProcessState, Supervisor
from audit import read_records

FILE = """\
# Our appliance. Tuned by ops, 2026-11.
[gateway]
# the port our clients know
port = 8443  # agreed with the network team
max_connections = 900

[keycloak]
gateway_client_secret = "s3cret"

[[pools]]
name = "main"
model = "demo"
"""


@pytest.fixture
def settings_file(home: Home) -> Path:
    home.settings_file.write_text(FILE)
    return home.settings_file


def test_show_gives_one_value_or_all_with_secrets_masked(settings_file: Path) -> None:
    settings = load_settings(settings_file, environ={})
    assert show(settings, "gateway.port") == 8443
    assert show(settings, "pools.main.model") == "demo"
    assert show(settings, "keycloak.gateway_client_secret") == MASK
    assert show(settings)["keycloak"]["gateway_client_secret"] == MASK
    assert show(settings, "gateway.limits")["user"]["requests_per_minute"] > 0


def test_show_of_an_unknown_key_names_the_nearest(settings_file: Path) -> None:
    with pytest.raises(Invalid, match="gateway.prot: no such setting") as raised:
        show(load_settings(settings_file, environ={}), "gateway.prot")
    assert raised.value.hint == "did you mean gateway.port?"


def test_set_changes_that_line_only_and_keeps_its_comment(settings_file: Path, home: Home) -> None:
    change = set_value(home, "gateway.port", "9443", environ={})
    assert (change.old, change.new, change.describe()) == (8443, 9443, "gateway.port: 8443 -> 9443")
    assert settings_file.read_text() == FILE.replace("port = 8443  #", "port = 9443  #")


def test_set_adds_a_missing_key_to_its_table_and_a_missing_table_at_the_end(settings_file: Path, home: Home) -> None:
    set_value(home, "gateway.header_timeout_s", "7.5", environ={})
    set_value(home, "gateway.limits.user.requests_per_minute", "30", environ={})
    set_value(home, "pools.main.enable_lora", "true", environ={})
    set_value(home, "watchdog.enabled", "false", environ={})
    text = settings_file.read_text()
    assert text.startswith(FILE.split("\n[keycloak]")[0].replace("max_connections = 900",
                           "max_connections = 900\nheader_timeout_s = 7.5\nlimits.user.requests_per_minute = 30"))
    assert 'model = "demo"\nenable_lora = true\n\n[watchdog]\nenabled = false\n' in text
    settings = load_settings(settings_file, environ={})
    assert settings.gateway.header_timeout_s == 7.5 and settings.gateway.limits["user"].requests_per_minute == 30
    assert settings.pool("main").enable_lora and not settings.watchdog.enabled


def test_set_on_a_file_without_pools_writes_the_default_pool(home: Home) -> None:
    set_value(home, "pools.main.enable_lora", "true", environ={})
    assert home.settings_file.read_text() == '[[pools]]\nname = "main"\nenable_lora = true\n'
    assert load_settings(home.settings_file, environ={}).pool("main").enable_lora


def test_a_value_that_is_not_toml_is_a_string(settings_file: Path, home: Home) -> None:
    set_value(home, "gateway.bind", "0.0.0.0", environ={})
    assert 'bind = "0.0.0.0"' in settings_file.read_text()


@pytest.mark.parametrize(("key", "value", "error", "message"), [
    ("gateway.prot", "9443", Invalid, "gateway.prot: no such setting"),
    ("gateway.limits.user.requests_per_minut", "5", Invalid, "no such setting"),
    ("gatway.port", "9443", Invalid, "gatway.port: no such setting"),
    ("gateway.port", "high", SettingsError, "settings.toml:4: gateway.port: Input should be a valid integer"),
    ("gateway.port", "80", SettingsError, "gateway.port: Input should be greater than or equal to 1024"),
    ("pools.other.model", "x", Invalid, "pools.other.model: no pool named 'other'"),
    ("gateway.public_url", "https://a\nb", Invalid, "control character"),
    # bytes that are not UTF-8 on the command line arrive as lone surrogates, which no file can hold
    ("pools.main.model", "x\udcff", Invalid, "must be UTF-8 text"),
    ("pools.main.mod\udcffel", "x", Invalid, "must be UTF-8 text"),
    ("gateway", "1", Invalid, "gateway: no such setting"),
    ("keycloak.gateway_client_secret", "x", Invalid, "a secret is never given on the command line"),
    ("artifacts.s3_secret_key.part", "x", Invalid, "a secret is never given on the command line"),
])
def test_a_refused_set_changes_nothing(settings_file: Path, home: Home, key: str, value: str, error: type[Exception],
                                       message: str) -> None:
    with pytest.raises(error, match=message):
        set_value(home, key, value, environ={})
    assert settings_file.read_text() == FILE


def test_an_unknown_key_hints_at_the_nearest(settings_file: Path, home: Home) -> None:
    with pytest.raises(Invalid) as raised:
        set_value(home, "gateway.limits.user.requests_per_minut", "5", environ={})
    assert raised.value.hint == "did you mean gateway.limits.user.requests_per_minute?"


def test_a_value_spanning_lines_is_left_to_a_hand_edit(home: Home) -> None:
    text = '[gateway]\ntrusted_proxies = [\n  "10.0.0.1",\n]\n'
    home.settings_file.write_text(text)
    with pytest.raises(SettingsError, match="gateway.trusted_proxies: its value spans several lines"):
        set_value(home, "gateway.trusted_proxies", '["10.0.0.2"]', environ={})
    assert home.settings_file.read_text() == text


def test_set_leaves_the_file_private_and_says_when_a_variable_overrides_it(settings_file: Path, home: Home) -> None:
    change = set_value(home, "gateway.port", "9443", environ={"APPLIANCE_GATEWAY__PORT": "9000"})
    assert change.overridden_by == "APPLIANCE_GATEWAY__PORT" and change.new == 9000
    assert settings_file.stat().st_mode & 0o777 == 0o600
    # A variable for a table holding the key decides it too (the change was silently not in effect).
    limits = "{ user = { max_tokens = 100 } }"
    change = set_value(home, "gateway.limits.user.max_tokens", "4", environ={"APPLIANCE_GATEWAY__LIMITS": limits})
    assert change.overridden_by == "APPLIANCE_GATEWAY__LIMITS" and change.new == 100


def test_set_is_audited_with_the_old_and_new_value_and_refuses_secrets(settings_file: Path, home: Home,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOME_ENV, str(home.root))
    for name in [name for name in os.environ if name.startswith("APPLIANCE_") and name != HOME_ENV]:
        monkeypatch.delenv(name)
    runner = CliRunner()
    assert runner.invoke(settings_app, ["set", "gateway.port", "9443"]).exit_code == 0
    assert runner.invoke(settings_app, ["set", "keycloak.gateway_client_secret", "other"]).exit_code != 0
    refused = runner.invoke(settings_app, ["set", "gateway.port", "high"])
    assert refused.exit_code != 0
    shown = runner.invoke(settings_app, ["show", "gateway.port"])
    assert shown.stdout == "9443\n"
    records = list(read_records(home.audit))
    assert [(r["action"], r["outcome"], r["target"]["name"]) for r in records] == [
        ("settings.set", "allowed", "gateway.port"), ("settings.set", "invalid", "keycloak.gateway_client_secret"),
        ("settings.set", "invalid", "gateway.port")]
    assert records[0]["detail"] == "gateway.port: 8443 -> 9443"
    assert "never given on the command line" in records[1]["error"] and "other" not in json.dumps(records[1])
    assert "valid integer" in records[2]["error"]


# --- apply ---

def _program(name: str, *, pool: str | None = None, reads: bool = False, priority: int = 100,
             **more: Any) -> Program:
    return Program(name=name, command=["run", name], pool=pool, priority=priority,
                   environment={HOME_ENV: "/h"} if reads else {}, **more)


def _programs() -> list[Program]:
    return [_program("keycloak", priority=10), _program("vllm-main", pool="main", priority=50),
            _program("vllm-main_1", pool="main", priority=50), _program("vllm-other", pool="other", priority=50),
            _program("gateway", reads=True, priority=90), _program("batch-worker", reads=True, priority=96),
            _program("finetune-worker", reads=True, priority=95), _program("rl-worker", reads=True, priority=96),
            _program("prometheus", priority=95)]


def _started(**changes: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    base = Settings.model_validate({"pools": [{"name": "main", "replicas": 2}, {"name": "other"}]})
    changed = base.model_copy(deep=True)
    for dotted, value in changes.items():
        section, name = dotted.split("__")
        setattr(getattr(changed, section), name, value)
    return base.comparable(), changed.comparable()


def _restarts(started: dict[str, Any], current: dict[str, Any], wanted: list[Program] | None = None) -> list[str]:
    return [step.program.name for step in plan(started, current, _programs(), wanted or _programs()).restarts]


def test_apply_plans_the_programs_each_section_touches() -> None:
    assert _restarts(*_started(gateway__max_connections=10)) == ["gateway"]
    assert _restarts(*_started(batch__max_requests=5)) == ["gateway", "batch-worker"]
    assert _restarts(*_started(keycloak__realm="other")) == ["keycloak", "gateway"]
    # Where the gateway listens: whoever reaches it too.
    assert _restarts(*_started(gateway__port=9443)) == ["gateway", "prometheus", "batch-worker", "rl-worker"]
    # A section no program is mapped to: every program that reads the settings file.
    assert _restarts(*_started(audit__max_file_bytes=1 << 20)) == ["gateway", "finetune-worker", "batch-worker",
                                                                    "rl-worker"]


def test_a_limits_change_restarts_the_batch_worker_that_caps_batch_lines_with_them() -> None:
    started, current = _started()
    current["gateway"]["limits"]["user"]["max_tokens"] = 10
    assert changed_keys(started, current) == ["gateway.limits.user.max_tokens"]
    assert _restarts(started, current) == ["gateway", "batch-worker"]


def test_a_pools_change_restarts_its_replicas_one_after_the_other_then_the_gateway() -> None:
    started, current = _started()
    current["pools"][0]["enable_lora"] = not current["pools"][0]["enable_lora"]
    assert changed_keys(started, current) == ["pools.main.enable_lora"]
    assert _restarts(started, current) == ["vllm-main", "vllm-main_1", "gateway", "rl-worker"]


def test_a_secret_change_is_seen_though_never_recorded() -> None:
    started, current = _started(keycloak__gateway_client_secret="new")
    assert "new" not in json.dumps(current)
    assert changed_keys(started, current) == ["keycloak.gateway_client_secret"]


def test_a_changed_supervisord_configuration_replaces_the_program() -> None:
    started, current = _started(backup__keep=3)
    wanted = [p.model_copy(update={"command": ["run", "new"]}) if p.name == "finetune-worker" else p
              for p in _programs()]
    steps = plan(started, current, _programs(), wanted).restarts
    assert [(s.program.name, s.reconfigured) for s in steps] == [("finetune-worker", True)]


def test_nothing_changed_plans_nothing_and_added_programs_need_a_restart() -> None:
    started, _ = _started()
    assert plan(started, started, _programs(), _programs()).changed == []
    _, current = _started(gateway__max_connections=10)
    with pytest.raises(Conflict, match="adds vllm-main_2"):
        plan(started, current, _programs(), [*_programs(), _program("vllm-main_2", pool="main")])


def test_a_program_the_cluster_controller_starts_is_left_with_a_reason() -> None:
    started, current = _started()
    current["pools"][1]["enable_lora"] = not current["pools"][1]["enable_lora"]
    wanted = [p.model_copy(update={"autostart": False}) if p.name == "vllm-other" else p for p in _programs()]
    result = plan(started, current, wanted, wanted)
    assert [s.program.name for s in result.restarts] == ["gateway", "rl-worker"]
    assert result.left[0].startswith("vllm-other: started by the cluster controller")


class FakeSupervisor(Supervisor):
    """supervisord's RPC as a record of calls: a program restarted reaches RUNNING after two
    polls; one named in `fails` goes to FATAL."""

    def __init__(self, home: Home, programs: list[Program], fails: set[str] | None = None) -> None:
        super().__init__(home)
        self.states = {p.name: ProcessState.RUNNING for p in programs}
        self.polls: dict[str, int] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.fails = fails or set()
        self.running = True

    def is_running(self) -> bool:
        return self.running

    def call(self, method: str, *args: Any) -> Any:
        self.calls.append((method, *args))
        if method in ("startProcess", "addProcessGroup"):
            assert all(state == ProcessState.RUNNING for name, state in self.states.items() if name != args[0]), \
                "a program is restarted only once the one before it runs again"
            self.states[args[0]] = ProcessState.STARTING
            self.polls[args[0]] = 0
        elif method in ("stopProcess", "stopProcessGroup"):
            self.states[args[0]] = ProcessState.STOPPED
        elif method == "getProcessInfo":
            return {"state": self.states[args[0]]}
        elif method == "getAllProcessInfo":
            return [self._info(name) for name in self.states]
        return True

    def _info(self, name: str) -> dict[str, Any]:
        if self.states[name] == ProcessState.STARTING:
            self.polls[name] += 1
            if self.polls[name] >= 2:
                self.states[name] = ProcessState.FATAL if name in self.fails else ProcessState.RUNNING
        return {"name": name, "state": self.states[name], "pid": 100, "now": 10, "start": 1,
                "stdout_logfile": "/dev/null", "description": ""}


def _running_appliance(home: Home, started: Settings) -> None:
    lifecycle.record_started(home, started, _programs())


def _restarted(supervisor: FakeSupervisor) -> list[str]:
    return [str(call[1]) for call in supervisor.calls if call[0] in ("startProcess", "addProcessGroup")]


def test_apply_restarts_replicas_one_at_a_time_then_records_the_new_settings(home: Home) -> None:
    started = Settings.model_validate({"pools": [{"name": "main", "replicas": 2}, {"name": "other"}]})
    _running_appliance(home, started)
    changed = Settings.model_validate({"pools": [{"name": "main", "replicas": 2, "max_loras": 8},
                                                 {"name": "other"}]})
    supervisor = FakeSupervisor(home, _programs())
    report = apply(changed, home, supervisor=supervisor, discover=lambda s, h: _programs())
    assert report.plan.changed == ["pools.main.max_loras"]
    assert report.restarted == _restarted(supervisor) == ["vllm-main", "vllm-main_1", "gateway", "rl-worker"]
    assert ("stopProcess", "vllm-main", True) in supervisor.calls
    assert apply(changed, home, supervisor=supervisor, discover=lambda s, h: _programs()).plan.changed == []


def test_apply_with_nothing_changed_touches_nothing(home: Home) -> None:
    _running_appliance(home, Settings())
    supervisor = FakeSupervisor(home, _programs())
    report = apply(Settings(), home, supervisor=supervisor, discover=lambda s, h: pytest.fail("not asked"))
    assert report.plan.changed == [] and report.restarted == [] and supervisor.calls == []


def test_apply_replaces_a_reconfigured_program_from_a_reread_configuration(home: Home) -> None:
    _running_appliance(home, Settings())
    wanted = [p.model_copy(update={"command": ["run", "new"]}) if p.name == "gateway" else p for p in _programs()]
    supervisor = FakeSupervisor(home, _programs())
    apply(Settings.model_validate({"gateway": {"max_connections": 900}}), home, supervisor=supervisor,
          discover=lambda s, h: wanted)
    assert [c[0] for c in supervisor.calls if c[0] not in ("getAllProcessInfo",)] == [
        "reloadConfig", "stopProcessGroup", "removeProcessGroup", "addProcessGroup"]
    assert "run new" in (home.run / "supervisord.conf").read_text()
    assert lifecycle.started_programs(home) == wanted


def test_apply_stops_at_a_program_that_fails_and_keeps_the_old_record(home: Home) -> None:
    _running_appliance(home, Settings())
    supervisor = FakeSupervisor(home, _programs(), fails={"gateway"})
    with pytest.raises(StartError, match="gateway did not start again after the settings changed"):
        apply(Settings.model_validate({"batch": {"max_requests": 5}}), home, supervisor=supervisor,
              discover=lambda s, h: _programs())
    assert _restarted(supervisor) == ["gateway"], "the batch worker after it was left as it was"
    assert lifecycle.started_settings(home) == Settings().comparable()


def test_apply_refuses_when_not_running_or_without_a_record(home: Home) -> None:
    supervisor = FakeSupervisor(home, _programs())
    with pytest.raises(Conflict, match="no record of the settings"):
        apply(Settings(), home, supervisor=supervisor)
    supervisor.running = False
    with pytest.raises(Conflict, match="not running"):
        apply(Settings(), home, supervisor=supervisor)


def test_apply_stops_nothing_when_a_new_port_is_taken(home: Home) -> None:
    _running_appliance(home, Settings())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        wanted = [p.model_copy(update={"port": port}) if p.name == "gateway" else p for p in _programs()]
        supervisor = FakeSupervisor(home, _programs())
        with pytest.raises(StartError, match=f"gateway: port {port} is already in use"):
            apply(Settings.model_validate({"gateway": {"port": port}}), home, supervisor=supervisor,
                  discover=lambda s, h: wanted)
    assert supervisor.calls == [] and lifecycle.started_settings(home) == Settings().comparable()


def test_apply_on_an_appliance_that_is_down_says_so_and_is_audited(settings_file: Path, home: Home,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOME_ENV, str(home.root))
    for name in [name for name in os.environ if name.startswith("APPLIANCE_") and name != HOME_ENV]:
        monkeypatch.delenv(name)
    result = CliRunner().invoke(settings_app, ["apply"])
    assert result.exit_code != 0 and isinstance(result.exception, Conflict)
    assert "not running" in str(result.exception)
    [record] = list(read_records(home.audit))
    assert (record["action"], record["outcome"]) == ("settings.apply", "invalid")


# --- settings a program takes while it runs (appliance.live_settings) ---

LOWER_LIMITS = {"gateway": {"limits": {"user": {"max_tokens": 10}}}}


class HangupSupervisor(FakeSupervisor):
    """FakeSupervisor whose gateway answers SIGHUP with `answer(digest of the new live values)`,
    or not at all (None)."""

    def __init__(self, home: Home, answer: Callable[[str], live_settings.Taken] | None, expected: Settings) -> None:
        super().__init__(home, _programs())
        self.answer, self.expected = answer, expected

    def call(self, method: str, *args: Any) -> Any:
        if method != "signalProcess":
            return super().call(method, *args)
        self.calls.append((method, *args))
        if self.answer is not None:
            live_settings.say_taken(self.home, args[0], self.answer(live_settings.digest(
                args[0], self.expected.comparable())))
        return True


def test_a_limits_change_is_taken_by_the_running_gateway_and_restarts_only_the_batch_worker(home: Home) -> None:
    _running_appliance(home, Settings())
    changed = Settings.model_validate(LOWER_LIMITS)
    started, current = Settings().comparable(), changed.comparable()
    steps = plan(started, current, _programs(), _programs()).restarts
    assert [(s.program.name, s.live) for s in steps] == [("gateway", True), ("batch-worker", False)]
    supervisor = HangupSupervisor(home, lambda digest: live_settings.Taken(pid=100, digest=digest), changed)
    report = apply(changed, home, supervisor=supervisor, discover=lambda s, h: _programs())
    assert (report.taken_live, report.restarted, report.notices) == (["gateway"], ["batch-worker"], [])
    assert ("signalProcess", "gateway", "HUP") in supervisor.calls
    assert _restarted(supervisor) == ["batch-worker"] and ("stopProcess", "gateway", True) not in supervisor.calls
    assert lifecycle.started_settings(home) == current


@pytest.mark.parametrize(("answer", "why"), [
    (lambda digest: live_settings.Taken(pid=100, digest=None, problem="gateway.limits.user: bad"),
     "gateway.limits.user: bad"),
    (lambda digest: live_settings.Taken(pid=100, digest="0" * 64), "it holds other values than the settings file"),
    (lambda digest: live_settings.Taken(pid=7, digest=digest), "no answer within"),  # another process's
    (None, "no answer within")])
def test_a_gateway_that_does_not_take_the_change_is_restarted_saying_why(
        home: Home, monkeypatch: pytest.MonkeyPatch, answer: Callable[[str], live_settings.Taken] | None,
        why: str) -> None:
    monkeypatch.setattr(live_settings, "ANSWER_TIMEOUT_S", 0.3)
    _running_appliance(home, Settings())
    changed = Settings.model_validate(LOWER_LIMITS)
    report = apply(changed, home, supervisor=(supervisor := HangupSupervisor(home, answer, changed)),
                   discover=lambda s, h: _programs())
    assert report.taken_live == [] and report.restarted == _restarted(supervisor) == ["gateway", "batch-worker"]
    [notice] = report.notices
    assert notice.startswith(f"gateway did not take gateway.limits.user.max_tokens while running ({why}")
    assert notice.endswith("); it was restarted")


def test_a_change_the_gateway_reads_only_at_start_restarts_it_without_a_signal(home: Home) -> None:
    _running_appliance(home, Settings())
    changed = Settings.model_validate({**LOWER_LIMITS, "gateway": {**LOWER_LIMITS["gateway"], "max_connections": 900}})
    supervisor = HangupSupervisor(home, lambda digest: pytest.fail("not signalled"), changed)
    report = apply(changed, home, supervisor=supervisor, discover=lambda s, h: _programs())
    assert report.restarted == ["gateway", "batch-worker"] and report.taken_live == []
    assert not any(call[0] == "signalProcess" for call in supervisor.calls)
