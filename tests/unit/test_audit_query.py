"""Audit queries: --since/--until as instants in every accepted form (records of the same second
included when at or after it), garbage refused by name, and the user, action, outcome and object
filters of `audit export`, `audit tail` and GET /admin/audit."""

from __future__ import annotations

import itertools
import json
import subprocess
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from appliance import cli
from appliance.errors import Invalid, StateError
from appliance.home import HOME_ENV, Home
from appliance.settings import Settings
from audit import AuditWriter, read_records
from audit.reader import ObjectFilter, RecordFilter, parse_outcome
from audit.times import parse_instant, record_instant
from audit.writer import log_files
from serve.auth import Principal
from serve.gateway import create_app
from serve.metrics import Metrics
from tests.support.appliances import APPLIANCE
from tests.support.audit import event

KEY = Ed25519PrivateKey.generate()
# Written in this order, at these times: a record just before the date, then five about 10:00:00.
TIMELINE = {"eve": "2026-10-31T23:59:59.999999Z", "r0": "2026-11-01T09:59:59.999999Z",
            "r1": "2026-11-01T10:00:00.000000Z", "r2": "2026-11-01T10:00:00.250000Z",
            "r3": "2026-11-01T10:00:00.750000Z", "r4": "2026-11-01T10:00:01.000000Z"}
# Who did what to which object, by request id (chat.completions by alice, allowed, unless said).
DEEDS: dict[str, dict[str, Any]] = {
    "eve": {},
    "r0": {"action": "users.add", "username": "root", "target": {"kind": "user", "name": "alice"}},
    "r1": {"action": "adapters.deploy", "username": "bob", "target": {"kind": "adapter", "name": "alice",
                                                                       "version": 2}},
    "r2": {"outcome": "denied", "status": 403, "username": "bob"},
    "r3": {"action": "batches.create", "outcome": "invalid", "status": 400, "target": {"kind": "batch",
                                                                                        "name": "b-1:7"}},
    "r4": {"outcome": "error", "status": 500, "target": None},
}


def write(directory: Path, monkeypatch: pytest.MonkeyPatch, timeline: dict[str, str],
          **writer_options: Any) -> None:
    """Real records, one flush each, stamped with `timeline`'s times in its order."""
    times = iter(timeline.values())
    with monkeypatch.context() as patched:
        patched.setattr("audit.writer._now", lambda: next(times))
        writer = AuditWriter(directory, KEY, **writer_options)
        try:
            for request_id in timeline:
                writer.append(event(0, request_id=request_id, **DEEDS.get(request_id, {})))
        finally:
            writer.close()


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    write(tmp_path / "audit", monkeypatch, TIMELINE)
    return tmp_path / "audit"


def ids(records: Iterator[dict[str, Any]]) -> list[str]:
    return [record["request_id"] for record in records]


# -- times -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("since", "expected"), [
    ("2026-11-01T10:00:00Z", ["r1", "r2", "r3", "r4"]),  # as text, r1-r3 sort before it and were lost
    ("2026-11-01T10:00:00.000000Z", ["r1", "r2", "r3", "r4"]),
    ("2026-11-01T10:00:00.25Z", ["r2", "r3", "r4"]),
    ("2026-11-01t10:00:00.250001z", ["r3", "r4"]),
    ("2026-11-01T11:00:00+01:00", ["r1", "r2", "r3", "r4"]),  # as text, nothing
    ("2026-11-01T05:00:00.5-05:00", ["r3", "r4"]),
    ("2026-11-01 10:00+0000", ["r1", "r2", "r3", "r4"]),
    ("2026-11-01", ["r0", "r1", "r2", "r3", "r4"]),  # its UTC midnight
    ("2026-11-02", []),
])
def test_since_is_an_instant_and_inclusive(log: Path, since: str, expected: list[str]) -> None:
    start = parse_instant(since, name="--since")
    assert ids(read_records(log, since=start)) == expected
    assert ids(read_records(log, since=start, newest_first=True)) == expected[::-1]


@pytest.mark.parametrize(("until", "expected"), [
    ("2026-11-01T10:00:00.75Z", ["eve", "r0", "r1", "r2"]),  # r3, exactly then, is left out
    ("2026-11-01T10:00:00Z", ["eve", "r0"]),
    ("2026-11-01", ["eve"]),
    ("2026-11-01T12:00:01+02:00", ["eve", "r0", "r1", "r2", "r3"]),
])
def test_until_is_exclusive(log: Path, until: str, expected: list[str]) -> None:
    end = parse_instant(until, name="--until")
    assert ids(read_records(log, until=end)) == expected
    assert ids(read_records(log, until=end, newest_first=True)) == expected[::-1]


def test_a_span_counts_back_from_now(log: Path) -> None:
    now = datetime(2026, 11, 1, 11, 0, 0, 250000, tzinfo=UTC)
    assert ids(read_records(log, since=parse_instant("1h", name="--since", now=now))) == ["r2", "r3", "r4"]
    assert ids(read_records(log, since=parse_instant("3600s", name="--since", now=now))) == ["r2", "r3", "r4"]
    assert ids(read_records(log, since=parse_instant("61m", name="--since", now=now))) == ["r0", "r1", "r2", "r3",
                                                                                            "r4"]
    assert parse_instant("2d", name="x", now=now) == now - timedelta(days=2)
    assert parse_instant("1w", name="x", now=now) == now - timedelta(weeks=1)
    assert parse_instant("0s", name="x", now=now) == now


def test_the_reader_still_takes_the_writers_text(log: Path) -> None:
    assert ids(read_records(log, since=TIMELINE["r2"], until=TIMELINE["r4"])) == ["r2", "r3"]


@pytest.mark.parametrize(("text", "says"), [
    ("yesterday", "is not a time: use an RFC 3339 time with Z or an offset"),
    ("", "is not a time"),
    (" 1h", "is not a time"),
    ("1y", "is not a time"),
    ("-1h", "is not a time"),
    ("1.5h", "is not a time"),
    ("1H", "is not a time"),
    ("2026-11-01T10:00", "has no time zone: add Z for UTC or an offset such as +01:00"),
    ("2026-11-01T10:00:00.5", "has no time zone"),
    ("2026-11-01T10:00:00+1", "is not a time"),
    ("2026-11-01T10:00:00 Z", "is not a time"),
    ("20261101T100000Z", "is not a time"),
    ("2026-13-01", "is out of range: month must be in 1..12"),
    ("2026-02-30T10:00:00Z", "is out of range"),
    ("2026-11-01T24:00:00Z", "is out of range"),
    ("2026-11-01T10:00:00+24:00", "is out of range"),
    ("0001-01-01T00:00:00+01:00", "is out of range"),
    ("99999999999999w", "is out of range"),
    ("9" * 5000 + "s", "is out of range"),
])
def test_anything_else_is_refused_by_name(text: str, says: str) -> None:
    with pytest.raises(Invalid) as refused:
        parse_instant(text, name="--since")
    assert refused.value.message.startswith(f"--since {text!r} ") and says in refused.value.message


OFFSETS = st.integers(min_value=-(24 * 60 - 1), max_value=24 * 60 - 1).map(lambda m: timezone(timedelta(minutes=m)))
INSTANTS = st.datetimes(min_value=datetime(2, 1, 1), max_value=datetime(9998, 12, 31), timezones=OFFSETS)


@given(INSTANTS, st.sampled_from(["seconds", "milliseconds", "microseconds"]))
def test_an_instant_written_in_any_offset_reads_back_as_itself(instant: datetime, timespec: str) -> None:
    shown = instant.replace(microsecond=0) if timespec == "seconds" else instant
    shown = shown.replace(microsecond=shown.microsecond // 1000 * 1000) if timespec == "milliseconds" else shown
    assert parse_instant(shown.isoformat(timespec=timespec), name="x") == shown
    in_utc = shown.astimezone(UTC).isoformat(timespec=timespec).replace("+00:00", "Z")
    assert parse_instant(in_utc, name="x") == shown


@given(INSTANTS, INSTANTS)
def test_the_writers_text_orders_as_its_instants(first: datetime, second: datetime) -> None:
    """The log's own `time` text and the instant it names agree, in value and in order."""
    texts = [moment.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
             for moment in (first, second)]
    instants = [record_instant({"seq": 1, "time": text}) for text in texts]
    assert instants == [first, second]
    assert (texts[0] < texts[1]) == (first < second) and (texts[0] == texts[1]) == (first == second)


@given(st.dates(min_value=date(1, 1, 1), max_value=date(9999, 12, 31)))
def test_a_date_is_its_utc_midnight(day: date) -> None:
    assert parse_instant(day.isoformat(), name="x") == datetime(day.year, day.month, day.day, tzinfo=UTC)


@given(st.text())
def test_any_text_is_an_instant_or_refused_by_name(text: str) -> None:
    try:
        parsed = parse_instant(text, name="--until")
    except Invalid as refused:
        assert refused.message.startswith(f"--until {text!r} ")
    else:
        assert parsed.utcoffset() == timedelta(0)


@pytest.mark.parametrize("time", [None, 17, "", "yesterday", "2026-11-01T10:00:00", "2026-13-01T00:00:00Z"])
def test_a_record_without_a_readable_time_is_named(time: object) -> None:
    with pytest.raises(StateError, match=r"audit record seq 7 has no readable time"):
        record_instant({"seq": 7, "time": time})


def test_the_fast_paths_compare_instants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Oldest first skips closed files wholly before `since` (here one of garbage but its end);
    newest first stops at `since`, before reaching it."""
    start = datetime(2026, 11, 1, 10, tzinfo=UTC)
    timeline = {f"r{n}": (start + timedelta(milliseconds=10 * n)).isoformat().replace("+00:00", "Z")
                for n in range(200)}
    write(tmp_path, monkeypatch, timeline, max_file_bytes=4096)
    files = log_files(tmp_path)
    first_of_last_closed = json.loads(files[-2].read_bytes().splitlines()[0])
    files[0].write_bytes(b"not json\n" + files[0].read_bytes().splitlines()[-1] + b"\n")  # only its end is read
    # The same instant with an offset: as text it sorts after every record.
    since = record_instant(first_of_last_closed).astimezone(timezone(timedelta(hours=5, minutes=30)))
    forwards = ids(read_records(tmp_path, since=since))
    assert forwards[0] == first_of_last_closed["request_id"] and forwards[-1] == "r199"
    assert ids(read_records(tmp_path, since=since, newest_first=True)) == forwards[::-1]


# -- filters -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("where", "expected"), [
    (RecordFilter(user="bob"), ["r1", "r2"]),
    (RecordFilter(action="chat.completions"), ["eve", "r2", "r4"]),
    (RecordFilter(outcome="invalid"), ["r3"]),
    (RecordFilter(outcome="error"), ["r4"]),
    (RecordFilter(outcome="denied", user="bob"), ["r2"]),
    (RecordFilter(target=ObjectFilter(name="alice")), ["r0", "r1"]),  # any kind
    (RecordFilter(target=ObjectFilter(name="alice", kind="user")), ["r0"]),
    (RecordFilter(target=ObjectFilter(name="alice", kind="adapter"), user="bob"), ["r1"]),
    (RecordFilter(target=ObjectFilter.parse("batch:b-1:7", option="--object")), ["r3"]),
    (RecordFilter(target=ObjectFilter(name="b-1")), []),
    (RecordFilter(user="nobody"), []),
])
def test_filters(log: Path, where: RecordFilter, expected: list[str]) -> None:
    assert ids(read_records(log, where=where)) == expected


def test_records_without_a_target_match_no_object_filter() -> None:
    anything = ObjectFilter(name="alice")
    old = {"seq": 1, "username": "alice", "resource": "alice"}  # written before targets were recorded
    assert not RecordFilter(target=anything).matches(old)
    assert not RecordFilter(target=anything).matches({**old, "target": None})
    assert not RecordFilter(target=anything).matches({**old, "target": "alice"})
    assert RecordFilter(user="alice").matches(old)


@pytest.mark.parametrize(("text", "kind", "name"), [
    ("alice", None, "alice"), ("user:alice", "user", "alice"), ("rl_run:r-1", "rl_run", "r-1"),
    ("batch:b-1:7", "batch", "b-1:7"),
])
def test_an_object_is_kind_and_name_or_a_name(text: str, kind: str | None, name: str) -> None:
    assert ObjectFilter.parse(text, option="--object") == ObjectFilter(name=name, kind=kind)


@pytest.mark.parametrize("text", ["", ":alice", "user:", "User:alice", "my user:alice", "1:x"])
def test_a_malformed_object_is_refused_by_name(text: str) -> None:
    with pytest.raises(Invalid, match=r"^--object .* is not an object: use KIND:NAME \(user:alice"):
        ObjectFilter.parse(text, option="--object")


@pytest.mark.parametrize("outcome", ["allowed", "denied", "invalid", "error"])
def test_every_outcome_is_accepted(outcome: str) -> None:
    assert parse_outcome(outcome, option="--outcome") == outcome


@pytest.mark.parametrize("outcome", ["", "deny", "Allowed", "refused"])
def test_another_outcome_is_refused_with_the_choices(outcome: str) -> None:
    with pytest.raises(Invalid, match=r"^--outcome .* is not an outcome: use one of allowed, denied, invalid, error$"):
        parse_outcome(outcome, option="--outcome")


# -- the CLI -----------------------------------------------------------------------------------


def appliance(home: Home, *args: str) -> Any:
    return CliRunner().invoke(cli.app, list(args), env={HOME_ENV: str(home.root)})


def lines(output: str) -> list[str]:
    return [json.loads(line)["request_id"] for line in output.splitlines()]


def test_export_takes_every_form_and_the_filters(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    write(home.audit, monkeypatch, TIMELINE)
    for since in ("2026-11-01T10:00:00Z", "2026-11-01T11:00:00+01:00"):
        shown = appliance(home, "audit", "export", "--since", since, "--until", "2026-11-01T10:00:01Z")
        assert shown.exit_code == 0, shown.output
        assert lines(shown.output) == ["r1", "r2", "r3"]
    by_date = appliance(home, "audit", "export", "--since", "2026-11-01", "--user", "bob", "--outcome", "denied")
    assert lines(by_date.output) == ["r2"]
    by_object = appliance(home, "audit", "export", "--object", "user:alice", "--action", "users.add")
    assert lines(by_object.output) == ["r0"]
    as_csv = appliance(home, "audit", "export", "--object", "alice", "--format", "csv")
    assert [row.split(",")[3] for row in as_csv.output.splitlines()] == ["username", "root", "bob"]


def test_export_since_a_span_takes_records_of_this_second(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    write(home.audit, monkeypatch, {"old": "2026-11-01T10:00:00.000000Z"})
    writer = AuditWriter(home.audit, KEY)  # the clock's own times, all within a second or so
    for n in range(3):
        writer.append(event(n))
    writer.close()
    shown = appliance(home, "audit", "export", "--since", "1h")
    assert shown.exit_code == 0 and lines(shown.output) == ["r0", "r1", "r2"]
    first = json.loads(shown.output.splitlines()[0])["time"]
    same_second = first[:19] + "Z"  # the README's form: whole seconds
    assert lines(appliance(home, "audit", "export", "--since", same_second).output) == ["r0", "r1", "r2"]


@pytest.mark.parametrize(("args", "says"), [
    (["--since", "yesterday"], "--since 'yesterday' is not a time: use an RFC 3339 time"),
    (["--until", "2026-11-01T10:00"], "--until '2026-11-01T10:00' has no time zone"),
    (["--outcome", "deny"], "--outcome 'deny' is not an outcome"),
    (["--object", "user:"], "--object 'user:' is not an object"),
])
def test_export_refuses_garbage_by_name(home: Home, args: list[str], says: str) -> None:
    refused = appliance(home, "audit", "export", *args)
    assert refused.exit_code == 1 and isinstance(refused.exception, Invalid)
    assert says in refused.exception.message and refused.output == ""


@pytest.mark.integration  # runs the installed command
def test_the_command_says_what_was_wrong_and_exits_1(home: Home) -> None:
    run = subprocess.run([APPLIANCE, "audit", "export", "--since", "yesterday"], capture_output=True, text=True,
                         timeout=120, check=False, env={HOME_ENV: str(home.root), "COLUMNS": "400"})
    assert run.returncode == 1 and run.stdout == ""
    assert "--since 'yesterday' is not a time" in run.stderr and "90s, 15m, 12h, 30d, 52w" in run.stderr


def test_tail_filters_the_last_and_the_new(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    write(home.audit, monkeypatch, TIMELINE)
    assert lines(appliance(home, "audit", "tail", "-n", "1", "--user", "bob").output) == ["r2"]
    assert lines(appliance(home, "audit", "tail", "--object", "alice").output) == ["r0", "r1"]
    assert appliance(home, "audit", "tail", "--outcome", "nope").exit_code == 1

    class Stop(Exception):
        pass

    naps = itertools.count()

    def nap(seconds: float) -> None:
        """The first wait: bob and carol act; the second ends the command."""
        if next(naps):
            raise Stop
        writer = AuditWriter(home.audit, KEY)
        for n, who in enumerate(["bob", "carol", "bob"]):
            writer.append(event(n, request_id=f"new{n}", username=who))
        writer.close()

    monkeypatch.setattr("audit.cli.time.sleep", nap)
    followed = appliance(home, "audit", "tail", "-n", "0", "-f", "--user", "bob")
    assert isinstance(followed.exception, Stop) and lines(followed.output) == ["new0", "new2"]


# -- GET /admin/audit --------------------------------------------------------------------------


class Auditor:
    async def validate(self, header: str | None) -> Principal:
        return Principal(subject="s", username="auditor", client="c", roles=frozenset({"auditor"}), token_id="t",
                         expires_at=float("inf"))


@pytest.fixture
def gateway(home: Home, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    write(home.audit, monkeypatch, TIMELINE)
    app = create_app(Settings(), home)
    app.state.gateway = SimpleNamespace(validator=Auditor(), metrics=Metrics())
    return TestClient(app, raise_server_exceptions=False)  # not entered: no lifespan, no Keycloak needed


def test_the_api_takes_the_same_times_and_filters(gateway: TestClient) -> None:
    def query(**params: Any) -> list[str]:
        answer = gateway.get("/admin/audit", params={"until": "2026-11-02", **params})
        assert answer.status_code == 200, answer.text
        return [record["request_id"] for record in answer.json()]

    assert query(since="2026-11-01T11:00:00+01:00") == ["r1", "r2", "r3", "r4"]
    assert query(since="2026-11-01T10:00:00Z", newest=True, limit=2) == ["r4", "r3"]
    assert query(object="adapter:alice") == ["r1"]
    assert query(outcome="invalid") == ["r3"]
    assert query(user="bob", action="chat.completions") == ["r2"]


@pytest.mark.parametrize(("params", "param", "says"), [
    ({"since": "yesterday"}, "since", "query parameter 'since' 'yesterday' is not a time: use"),
    ({"until": "2026-11-01T10:00:00"}, "until", "has no time zone"),
    ({"object": ":x"}, "object", "query parameter 'object' ':x' is not an object"),
    ({"outcome": "deny"}, "outcome", "query parameter 'outcome' 'deny' is not an outcome: use one of allowed,"),
])
def test_the_api_refuses_garbage_naming_the_parameter(gateway: TestClient, params: dict[str, str], param: str,
                                                      says: str) -> None:
    answer = gateway.get("/admin/audit", params=params)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param and says in error["message"] and error["code"] == "invalid"
