"""/admin/rl (role `admin`): RL task sets, and runs (list with live figures, cancel, exports of a
finished run's trajectories as datasets, a finished run's attempts), and agent episodes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Response

from appliance import trajectories
from appliance.artifacts import artifact_store
from appliance.home import Home
from appliance.rl import episodes, exports, progress, runs
from appliance.rl.attempts import Attempt
from appliance.rl.episodes import Episode, EpisodeEntry
from appliance.rl.exports import Export, ExportAsk
from appliance.rl.progress import RunReport
from appliance.rl.tasks import TaskSet, load_tasksets
from appliance.settings import Settings
from serve.audit_trail import MONITORING
from serve.deps import requires

RowId = Annotated[int, Path(ge=1, le=2**63 - 1)]  # SQLite's integer range


def router(settings: Settings, home: Home) -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])

    @routes.get("/rl/tasksets", response_model=list[TaskSet], name="rl.tasksets.list", openapi_extra=MONITORING)
    def list_tasksets() -> list[TaskSet]:
        """Task sets for post-training from execution feedback."""
        return list(load_tasksets(home).values())

    @routes.get("/rl/runs", response_model=list[RunReport], name="rl.runs.list", openapi_extra=MONITORING)
    def list_runs() -> list[RunReport]:
        """RL runs, oldest first, with live figures (pass rate, rewards, sandbox queue and workers)."""
        return [progress.report(home, run) for run in runs.listing(home)]

    @routes.post("/rl/runs/{run_id}/cancel", response_model=RunReport, name="rl.runs.cancel")
    def cancel_run(run_id: RowId) -> RunReport:
        """Cancel a queued run at once, or ask its worker to stop a running one (attempts kept).
        No such run: 404; one that has ended: 409 (`illegal_transition`)."""
        return progress.report(home, runs.cancel(home, run_id))

    @routes.post("/rl/runs/{run_id}/exports", response_model=Export, status_code=202, name="rl.exports.create")
    def ask_export(run_id: RowId, ask: ExportAsk, response: Response) -> Export:
        """Ask the rl-worker to make the SFT set and/or the preference set of a run that ended, as
        training datasets (attempts at held-out tasks left out); its `Location` follows it. No such
        run: 404; one still running, without trajectories, or with an export unfinished: 409."""
        export = exports.ask(home, run_id, ask)
        response.headers["Location"] = f"/admin/rl/exports/{export.id}"
        return export

    @routes.get("/rl/exports/{export_id}", response_model=Export, name="rl.exports.read",
                openapi_extra=MONITORING)
    def read_export(export_id: RowId) -> Export:
        """One export: queued, running, or what it stored (or why it failed). No such export: 404."""
        return exports.get(home, export_id)

    @routes.get("/rl/exports", response_model=list[Export], name="rl.exports.list", openapi_extra=MONITORING)
    def list_exports() -> list[Export]:
        """Exports asked, oldest first: queued, running, or what each stored (or why it failed)."""
        return exports.listing(home)

    # Each read recorded (not summarised as monitoring): attempts hold prompts and generated code.
    @routes.get("/rl/runs/{run_id}/attempts", response_model=list[Attempt], name="rl.attempts.list")
    def run_attempts(run_id: RowId, task: Annotated[str | None, Query(max_length=200)] = None) -> list[Attempt]:
        """A finished run's attempts from its trajectories in the artifact store, every segment checked
        against its digest (a changed one: 409 `artifact_integrity`); `task` picks one task's attempts."""
        _, attempts = trajectories.read_run(artifact_store(settings.artifacts, home), home, run_id)
        return [attempt for attempt in attempts if task is None or attempt.task == task]

    @routes.get("/rl/episodes", response_model=list[EpisodeEntry], name="rl.episodes.list", openapi_extra=MONITORING)
    def list_episodes() -> list[EpisodeEntry]:
        """Agent episodes kept, oldest first: how each ended, its reward, its calls, failures by tool."""
        return list(episodes.episode_registry(home).read().values())

    # Recorded (not summarised): an episode holds the model's text and what its tools read.
    @routes.get("/rl/episodes/{episode_id}", response_model=Episode, name="rl.episodes.read")
    def read_episode(episode_id: Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")]) -> Episode:
        """An episode step by step: each answer, its calls and what each observed, checked against
        the digest it was kept with (a changed one: 409 `artifact_integrity`)."""
        return episodes.read(episode_id, artifact_store(settings.artifacts, home), home)

    return routes
