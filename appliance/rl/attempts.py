"""One answer to one task, executed and rewarded: a line of a run's trajectory."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field


class Attempt(BaseModel):
    """One answer to one task, executed: a line of a trajectory segment."""

    model_config = ConfigDict(extra="forbid")

    run: int
    task: str
    sample: int
    round: int = Field(description="0: the first answer; n: the n-th correction.")
    messages: list[dict[str, str]] = Field(description="The input context the model was given.")
    completion: str = Field(description="What the model answered.")
    code: str = Field(description="The program taken from it and executed.")
    status: str
    exit_reason: str
    tests_passed: int
    tests_total: int
    stdout: str
    stderr: str
    feedback: str = Field(description="The parsed error fed back for the next round ('' unless it failed).")
    reward: float = Field(description="Share of tests passed, plus the efficiency term, less the length penalty.")
    efficiency: float = Field(0.0, description="The reward's efficiency term (rl.efficiency_weight).")
    length_penalty: float = Field(0.0, description="What the answer's length took off the reward (rl.length_penalty).")
    completion_tokens: int | None = Field(None, description="The answer's tokens, as the engine counted them.")
    generate_s: float
    execute_s: float
    model: str = Field(description="The engine's name for what answered ('' if the gateway refused the request).")
    adapter: str | None
    adapter_version: int | None

    @property
    def key(self) -> str:
        return attempt_key(self.task, self.sample, self.round)


def attempt_key(task: str, sample: int, round_: int) -> str:
    return json.dumps([task, sample, round_])
