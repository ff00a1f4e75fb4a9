"""Changing settings while the appliance runs: `appliance settings show KEY`, `set KEY VALUE` and
`apply`.

`set` validates the whole file with the value in place (the settings models, their messages) and
only then replaces the file, atomically, with just that line changed (appliance.settings.editing).

`apply` compares the settings in effect with those the running programs started with, which `up`
records (appliance.lifecycle.record_started), and restarts only the programs the changed keys
touch (SECTION_PROGRAMS), plus any whose supervisord configuration changed, one at a time in start
order, each healthy before the next: a pool's replicas one by one.
"""

from __future__ import annotations

import difflib
import fcntl
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance import lifecycle, live_settings
from appliance.durable import replace_file
from appliance.errors import Conflict, Invalid, SettingsError, StartError
from appliance.home import HOME_ENV, Home
from appliance.live_settings import is_live
from appliance.programs import Program, discover_programs, run_provisioners
from appliance.supervisor import FAILED_STATES, ProcessState, Supervisor, log_file
from appliance.up_steps import up_lock

if TYPE_CHECKING:
    from appliance.settings import Settings

# The programs that read a section at start, beyond those whose supervisord configuration the
# section shapes (a changed command or environment is seen by itself). `pools.NAME.*` touches that
# pool's engines and POOL_READERS; `engine.*` and `cluster.*` every engine and every program that
# reads the settings file; a section not named here, every program that reads the settings file.
SECTION_PROGRAMS: dict[str, frozenset[str]] = {
    "gateway": frozenset({"gateway"}),
    "routing": frozenset({"gateway"}),
    "cache": frozenset({"gateway"}),
    "batch": frozenset({"gateway", "batch-worker"}),
    "keycloak": frozenset({"keycloak", "gateway"}),
    "monitoring": frozenset({"prometheus", "alertmanager", "gateway"}),
    "watchdog": frozenset({"watchdog", "batch-worker"}),
    "finetune": frozenset({"finetune-worker", "rl-worker"}),
    "rl": frozenset({"rl-worker"}),
    "execution": frozenset({"rl-worker"}),
    "backup": frozenset({"backup-scheduler"}),
}
POOL_READERS = frozenset({"gateway", "rl-worker"})
# Keys (a table's stands for every key under it) that programs beyond their section's read: where
# the gateway is reached (its URL), and the gateway's limits and caps the batch worker and the
# cluster listener apply too.
_REACH_GATEWAY = frozenset({"batch-worker", "rl-worker", "prometheus"})
KEY_PROGRAMS: dict[str, frozenset[str]] = {
    "gateway.bind": _REACH_GATEWAY,
    "gateway.port": _REACH_GATEWAY,
    "gateway.https": _REACH_GATEWAY,
    "gateway.max_body_bytes": frozenset({"batch-worker"}),
    "gateway.limits": frozenset({"batch-worker"}),  # its caps on a batch's lines (serve.batch_worker)
    "gateway.header_timeout_s": frozenset({"cluster"}),
}
_ENGINE_WIDE = {"engine", "cluster"}
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
Progress = Callable[[str], None]


def _no_progress(_: str) -> None:
    pass


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Settings data as {dotted key: value}, tables as well as their values, pools by name."""
    flat: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name == "pools" and not prefix and isinstance(value, list):
            value = {str(pool.get("name")): pool for pool in value if isinstance(pool, dict)}
        flat[key] = value
        if isinstance(value, dict):
            flat.update(flatten(value, f"{key}."))
    return flat


def _unknown(key: str, known: Mapping[str, Any]) -> Invalid:
    nearest = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"did you mean {nearest[0]}?" if nearest else "`appliance settings show --defaults` lists every setting"
    return Invalid(f"{key}: no such setting", hint=hint)


def show(settings: Settings, key: str | None = None) -> Any:
    """The settings in effect (secrets masked), or the value of one dotted key."""
    masked = settings.masked()
    if key is None:
        return masked
    known = flatten(masked)
    if key not in known:
        raise _unknown(key, known)
    return known[key]


@dataclass(frozen=True)
class SettingChange:
    """One setting written: its value in effect before and after (secrets masked)."""

    key: str
    old: Any
    new: Any
    overridden_by: str | None = None  # an APPLIANCE_* variable that still decides the value in effect

    def describe(self) -> str:
        """`key: old -> new`, as the audit log and the command say it."""
        return f"{self.key}: {_shown(self.old)} -> {_shown(self.new)}"


def _shown(value: Any) -> str:
    from appliance.settings.editing import render_value

    return "(unset)" if value is None else render_value(value)


def set_value(home: Home, key: str, raw: str, environ: Mapping[str, str] | None = None) -> SettingChange:
    """Set `key` to `raw` (read as a TOML value, else as a string) in the settings file: the file
    with the new value must validate whole, else it is left as it was. One `set` at a time: two at
    once would each write the file as it read it, losing the other's change."""
    home.ensure()
    fd = os.open(home.run / "settings.lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return _set_value(home.settings_file, key, raw, environ)
    finally:
        os.close(fd)


def _set_value(path: Path, key: str, raw: str, environ: Mapping[str, str] | None) -> SettingChange:
    from appliance.settings.editing import set_in_text
    from appliance.settings.loading import ENV_PREFIX, parse_settings, parse_value
    from appliance.settings.root import SECRET_FIELDS, Settings

    environ = os.environ if environ is None else environ
    if _CONTROL.search(key) or _CONTROL.search(raw):
        raise Invalid(f"{key!r}: a key or value may not hold a line break or other control character")
    try:
        f"{key}{raw}".encode()
    except UnicodeEncodeError:  # bytes not UTF-8 in the command line arrive as lone surrogates
        raise Invalid(f"{key!r}: a key or value must be UTF-8 text; this one holds bytes that are not") from None
    text = path.read_text() if path.exists() else None
    before = parse_settings(path, text, environ)
    parts = key.split(".")
    known = flatten(before.masked())
    if parts[0] not in Settings.model_fields or len(parts) < (3 if parts[0] == "pools" else 2):
        raise _unknown(key, known)
    if tuple(parts[:2]) in SECRET_FIELDS:  # a key under a secret too: what is typed there is the secret
        raise Invalid(f"{key}: a secret is never given on the command line (it would stay in the shell's history)",
                      hint=f"edit {path} by hand (0600), then `appliance settings apply`")
    if parts[0] == "pools" and parts[1] not in {pool.name for pool in before.pools}:
        raise Invalid(f"{key}: no pool named {parts[1]!r}", hint=f"pools: {[pool.name for pool in before.pools]}")
    edited = set_in_text(text or "", parts, parse_value(raw), str(path))
    try:
        after = parse_settings(path, edited, environ)
    except SettingsError as exc:
        if _unknown_field(exc):
            raise _unknown(key, known) from exc
        raise SettingsError(exc.message, hint=f"{path} is unchanged") from exc
    # Nothing but the key may change in effect (a table written where the defaults had several
    # entries could drop the others): the key, the tables holding it, and a new entry's other fields
    # (at their defaults).
    old, new, parent = known, flatten(after.masked()), key.rsplit(".", 1)[0]
    also = sorted(name for name in old.keys() | new.keys()
                  if old.get(name) != new.get(name) and name != key and not name.startswith(f"{key}.")
                  and not key.startswith(f"{name}.") and not (name not in old and name.startswith(f"{parent}.")))
    also = [name for name in also if not any(other.startswith(f"{name}.") for other in also)]  # leaves alone
    if also:
        raise Invalid(f"{key}: setting it here would also change {', '.join(also[:5])}",
                      hint=f"edit {path} by hand; it is unchanged")
    replace_file(path, edited.encode())  # 0600, as the state directory keeps it
    # The key's own variable, or one of a table holding it (APPLIANCE_GATEWAY__LIMITS sets them all).
    variables = [ENV_PREFIX + "__".join(parts[:length]).upper() for length in range(len(parts), 0, -1)]
    return SettingChange(key, known.get(key), flatten(after.masked()).get(key),
                         next((variable for variable in variables if variable in environ), None))


def _unknown_field(exc: SettingsError) -> bool:
    from pydantic import ValidationError

    cause = exc.__cause__
    return isinstance(cause, ValidationError) and cause.errors()[0]["type"] == "extra_forbidden"


def changed_keys(started: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The dotted keys whose values differ (leaves only: a changed table shows as its keys)."""
    old, new = flatten(started), flatten(current)
    return sorted(key for key in old.keys() | new.keys()
                  if old.get(key) != new.get(key) and not isinstance(old.get(key, new.get(key)), dict))


def _reads_settings(program: Program) -> bool:
    return HOME_ENV in program.environment


def touches(key: str, program: Program) -> bool:
    """Whether `program` reads setting `key` at start (see SECTION_PROGRAMS, KEY_PROGRAMS)."""
    parts = key.split(".")
    if parts[0] == "pools":
        return program.name in POOL_READERS or (len(parts) > 1 and program.pool == parts[1])
    if parts[0] in _ENGINE_WIDE:
        return program.pool is not None or _reads_settings(program)
    if parts[0] in SECTION_PROGRAMS:
        return program.name in SECTION_PROGRAMS[parts[0]] | KEY_PROGRAMS.get(".".join(parts[:2]), frozenset())
    return _reads_settings(program)


@dataclass(frozen=True)
class Restart:
    """One program to restart, and why: the changed keys it reads; `reconfigured`: its
    supervisord configuration changed, so it is replaced rather than restarted."""

    program: Program
    keys: tuple[str, ...]
    reconfigured: bool

    @property
    def live(self) -> bool:
        """The program takes every changed key it reads while it runs (appliance.live_settings)."""
        return not self.reconfigured and bool(self.keys) and all(is_live(self.program.name, k) for k in self.keys)


@dataclass
class Plan:
    """What `apply` does: the changed keys, the restarts in order, and the programs it leaves."""

    changed: list[str]
    restarts: list[Restart] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # why each program touched is not restarted


def plan(started: Mapping[str, Any], current: Mapping[str, Any], running: list[Program],
         wanted: list[Program]) -> Plan:
    """The restarts that bring `running` (started with settings `started`) to `wanted` (from
    `current`), in start order; Conflict if the change adds or removes programs."""
    changed = changed_keys(started, current)
    if not changed:
        return Plan(changed)
    before = {program.name: program for program in running}
    added = [program.name for program in wanted if program.name not in before]
    removed = sorted(before.keys() - {program.name for program in wanted})
    if added or removed:
        what = "; ".join(part for part in (added and f"adds {', '.join(added)}",
                                           removed and f"removes {', '.join(removed)}") if part)
        raise Conflict(f"the change {what}: programs are added or removed only by a restart",
                       hint="`appliance down`, then `appliance up`")
    result = Plan(changed)
    for program in sorted(wanted, key=lambda p: (p.priority, p.name)):
        keys = tuple(key for key in changed if touches(key, program))
        reconfigured = program != before[program.name]
        if not keys and not reconfigured:
            continue
        if not program.autostart:
            result.left.append(f"{program.name}: started by the cluster controller, not supervisord; "
                               "restart the pool's cluster to apply")
            continue
        result.restarts.append(Restart(program, keys, reconfigured))
    return result


@dataclass
class ApplyReport:
    """What `apply` did."""

    plan: Plan
    restarted: list[str] = field(default_factory=list)
    taken_live: list[str] = field(default_factory=list)  # programs that took the change without a restart
    notices: list[str] = field(default_factory=list)


def apply(settings: Settings, home: Home, progress: Progress = _no_progress, *,
          supervisor: Supervisor | None = None,
          discover: Callable[[Settings, Home], list[Program]] = discover_programs) -> ApplyReport:
    """Put the settings changed since the programs started in force, one program at a time: a
    program that takes every changed key it reads while running is sent SIGHUP and must say it
    holds the new values (else it is restarted, and the report says why); the others are restarted,
    each healthy before the next. Then record the settings as those the programs run with."""
    supervisor = supervisor or Supervisor(home)
    with up_lock(home):
        if not supervisor.is_running():
            raise Conflict("the appliance is not running: there is nothing to apply",
                           hint="`appliance up` starts it with the settings as they are")
        started = lifecycle.started_settings(home)
        if started is None:
            raise Conflict("no record of the settings the running programs started with (an `up` of an "
                           "earlier version)", hint="restart once: `appliance down`, then `appliance up`")
        current = settings.comparable()
        if not changed_keys(started, current):
            return ApplyReport(Plan([]))
        wanted = discover(settings, home)
        running = {program.name: program for program in lifecycle.started_programs(home)}
        steps = plan(started, current, list(running.values()), wanted)
        report = ApplyReport(steps, notices=list(steps.left))
        # Before anything stops: a program that could not start again is left running as it is.
        # (A port it keeps is its own; only a new one must be free.)
        lifecycle.check_startable([step.program.model_copy(update={"port": None})
                                   if step.program.port == running[step.program.name].port else step.program
                                   for step in steps.restarts], home)
        if any(step.reconfigured for step in steps.restarts):
            supervisor.reconfigure(lifecycle.supervisor_config(home, wanted))
        for step in steps.restarts:
            name = step.program.name
            if step.live:
                progress(f"{name} takes {', '.join(step.keys)} without a restart")
                problem = _take_live(supervisor, name, home, current)
                if problem is None:
                    report.taken_live.append(name)
                    continue
                report.notices.append(f"{name} did not take {', '.join(step.keys)} while running ({problem}); "
                                      "it was restarted")
            progress(f"restarting {name} ({', '.join(step.keys) or 'its configuration changed'})")
            if step.reconfigured:
                supervisor.replace(name)
            else:
                supervisor.restart(name)
            _until_running(supervisor, step.program, home)
            lifecycle.wait_ready(supervisor, [step.program], home, progress)
            report.restarted.append(name)
        if "keycloak" in report.restarted:
            report.notices += run_provisioners(settings, home)
        lifecycle.record_started(home, settings, wanted)
        return report


def _take_live(supervisor: Supervisor, name: str, home: Home, current: Mapping[str, Any]) -> str | None:
    """Send `name` SIGHUP and wait for it to say it holds `current`'s live values; None once it
    does, else why not."""
    info = next((p for p in supervisor.processes() if p.name == name), None)
    if info is None or info.state != ProcessState.RUNNING or not info.pid:
        return "it is not running"
    live_settings.forget_answer(home, name)
    supervisor.call("signalProcess", name, "HUP")
    return live_settings.await_answer(home, name, info.pid, live_settings.digest(name, current))


def _until_running(supervisor: Supervisor, program: Program, home: Home) -> None:
    """Wait until supervisord counts `program` started (up for its startsecs); StartError if it fails."""
    deadline = time.monotonic() + program.start_timeout_s
    while True:
        info = next((p for p in supervisor.processes() if p.name == program.name), None)
        state = info.state if info else ProcessState.UNKNOWN
        if state == ProcessState.RUNNING:
            return
        if state in FAILED_STATES or time.monotonic() > deadline:
            log = log_file(home, program.name)
            raise StartError(f"{program.name} did not start again after the settings changed "
                             f"({state.name.lower()}): {lifecycle.failure_reason(log)}", log=log,
                             hint="correct the setting (`appliance settings set`), then `appliance settings apply`")
        time.sleep(0.2)
