"""An agent's episode on a repository task (finetune.rl.environment runs it): every turn's tool
calls with what each observed, the reward and why the episode ended, and the digest of the
workspace it left, which a replay of the same calls must reach again."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_ARGUMENTS = 65536  # of one call's arguments' text: more is refused, not run
Ended = Literal["submitted", "answered", "steps", "tool_calls", "tokens", "wall_time", "contained", "refused"]


class ToolStep(BaseModel):
    """One tool call and what it observed."""

    model_config = ConfigDict(extra="forbid")

    call_id: str = Field(max_length=200)
    name: str = Field(max_length=200)
    arguments: str = Field(max_length=MAX_ARGUMENTS, description="As the model wrote them (JSON text).")
    output: str
    ok: bool  # the tool did its work (not refused, not failed)
    seconds: float


class Turn(BaseModel):
    """One answer of the model and the tool calls it made."""

    model_config = ConfigDict(extra="forbid")

    request_id: str | None = Field(None, max_length=200, description="The gateway's, for its audit record.")
    content: str
    completion_tokens: int
    generation_s: float = 0.0  # the gateway's answer, as the driver waited for it
    tools: list[ToolStep]
    refused: str | None = None  # the gateway refused this answer (its call failed the schema, say): why


class Episode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str
    model: str
    turns: list[Turn]
    ended: Ended
    reason: str  # in words: which budget, what was contained, what the tests said
    reward: float  # the share of the task's tests the final workspace passes; 0 when contained
    tests_passed: int
    tests_total: int
    workspace_sha256: str | None  # of the final workspace's files; None when it was lost
    seconds: float
    reset_s: float = 0.0  # the sandbox started and the task's files put in

    @property
    def tool_calls(self) -> int:
        return sum(len(turn.tools) for turn in self.turns)
