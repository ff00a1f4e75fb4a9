"""The watchdog's settings: when an engine, a training job, an RL run or batch work counts as stuck."""

from __future__ import annotations

from pydantic import Field, model_validator

from appliance.settings.section import Section


class WatchdogSettings(Section):
    """The supervised watchdog: an engine replica alive but making no progress is restarted; a
    worker whose training job, RL run or batch work makes no progress is ended, and its work taken
    over by the worker supervisord starts again (bounded retries)."""

    enabled: bool = Field(True, description="Run the watchdog.")
    check_interval_s: float = Field(2.0, ge=0.5, le=300, description="How often it asks every engine replica "
                                    "for its health and its counters.")
    engine_stall_s: float = Field(20.0, ge=5, le=86400, description="A replica whose health check has not "
                                  "answered, or that has held requests without producing a token or filling its "
                                  "KV cache (a long prefill does), for this long is restarted. A replica still "
                                  "starting is not judged until it has answered once or its start timeout has "
                                  "passed.")
    backoff_s: float = Field(60.0, ge=1, le=86400, description="After a replica's restart, its next one waits at "
                             "least this long, doubling with each restart...")
    max_backoff_s: float = Field(900.0, ge=1, le=86400, description="...up to this; a replica that then makes "
                                 "progress this long starts over from backoff_s.")
    training_stall_s: float = Field(1800.0, ge=10, le=604800, description="A training job whose trainer has "
                                    "reported no step (or whose worker has not started it) for this long: its "
                                    "worker is ended, and the job resumes from its last checkpoint.")
    rl_stall_s: float = Field(1800.0, ge=10, le=604800, description="An RL run that has generated and judged "
                              "nothing for this long: its worker is ended, and the run resumes.")
    batch_stall_s: float = Field(1800.0, ge=10, le=604800, description="A batch request or a batch's validation "
                                 "held this long: the batch worker is ended, and its work waits again.")

    @model_validator(mode="after")
    def _backoff_bounds(self) -> WatchdogSettings:
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"max_backoff_s ({self.max_backoff_s:g}) is less than backoff_s ({self.backoff_s:g})")
        return self
