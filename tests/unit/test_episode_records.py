"""Agent episodes kept (appliance.rl.episodes): put in the artifact store under their digest and
indexed, read back checked against it (a changed record refused); listed and shown step by step
by the CLI (the model's text shown, never read as markup or terminal control) and the admin API
(a bad id refused before anything is read; the list summarised, a record's read recorded)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from appliance import cli
from appliance.artifacts import ArtifactStore, artifact_store
from appliance.errors import IntegrityError, NotFound
from appliance.home import Home
from appliance.rl import episodes
from appliance.rl.episodes import Episode, ToolStep, Turn
from appliance.settings import Settings
from tests.support.admin_api import admin_client

HOSTILE = "[red]injected[/red]\x1b[2J\u202eevil"


def episode(**changes: object) -> Episode:
    turns = [Turn(request_id="r1", content=HOSTILE, completion_tokens=12, generation_s=1.5, tools=[
        ToolStep(call_id="c1", name="read_file", arguments='{"path": "a.py"}', output=f"1: {HOSTILE}", ok=True,
                 seconds=0.1),
        ToolStep(call_id="c2", name="shell", arguments='{"command": "false"}', output="[exit 1]", ok=False,
                 seconds=0.1)]),
        Turn(request_id="r2", content="", completion_tokens=64, tools=[], refused="gateway answered 502")]
    return Episode(**{"task": "calc-add", "model": "m", "turns": turns, "ended": "steps", "reason": "budget",
                      "reward": 0.5, "tests_passed": 1, "tests_total": 2, "workspace_sha256": "ab" * 32,
                      "seconds": 3.0, **changes})


@pytest.fixture
def artifacts(home: Home) -> ArtifactStore:
    return artifact_store(Settings().artifacts, home)


def test_an_episode_is_kept_indexed_and_read_back_checked(home: Home, artifacts: ArtifactStore) -> None:
    entry = episodes.keep(episode(), artifacts, home)
    assert (entry.answers, entry.tool_calls, entry.failed_calls, entry.reward) == (2, 2, {"shell": 1}, 0.5)
    assert episodes.read(entry.id, artifacts, home) == episode()
    assert list(episodes.episode_registry(home).read()) == [entry.id]
    with pytest.raises(NotFound):
        episodes.read("0" * 16, artifacts, home)
    artifacts.put(entry.key, episode(reward=1.0).model_dump_json(indent=1).encode(), retain_days=0)
    with pytest.raises(IntegrityError, match="changed since it was kept"):
        episodes.read(entry.id, artifacts, home)


def test_the_cli_lists_and_shows_step_by_step_never_as_markup(home: Home, artifacts: ArtifactStore,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIANCE_HOME", str(home.root))
    entry = episodes.keep(episode(), artifacts, home)
    runner = CliRunner()
    listed = runner.invoke(cli.app, ["rl", "episodes", "list", "--json"])
    assert listed.exit_code == 0 and json.loads(listed.output)[0]["id"] == entry.id
    shown = runner.invoke(cli.app, ["rl", "episodes", "show", entry.id], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "[red]injected[/red]" in shown.output and "\x1b" not in shown.output and "\u202e" not in shown.output
    for line in ("answer 1 (12 tokens, 1.5 s, request r1)", "  ok read_file", "  failed shell",
                 "  refused by the gateway: gateway answered 502"):
        assert line in shown.output
    missing = runner.invoke(cli.app, ["rl", "episodes", "show", "0123456789abcdef"])
    assert isinstance(missing.exception, NotFound) and "no episode" in str(missing.exception)


def test_the_admin_api_lists_and_reads_episodes(home: Home, artifacts: ArtifactStore) -> None:
    client, caller = admin_client(home)
    entry = episodes.keep(episode(), artifacts, home)
    assert [e["id"] for e in client.get("/admin/rl/episodes").json()] == [entry.id]
    assert Episode.model_validate(client.get(f"/admin/rl/episodes/{entry.id}").json()) == episode()
    assert client.get("/admin/rl/episodes/..%2F..%2Fetc").status_code in (404, 422)
    assert client.get("/admin/rl/episodes/ABCDEF0123456789").status_code == 422
    assert client.get("/admin/rl/episodes/0123456789abcdef").status_code == 404
    caller.roles = frozenset({"user"})
    assert client.get("/admin/rl/episodes").status_code == 403
