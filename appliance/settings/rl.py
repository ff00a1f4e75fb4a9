"""Post-training from execution feedback: the execution sandbox's limits and the RL runs' settings."""

from __future__ import annotations

from pydantic import Field

from appliance.settings.section import Section


class ExecutionSettings(Section):
    """The execution sandbox: untrusted programs (a model's answers) run against tests, each in
    a sandbox of its own (`appliance rl exec`)."""

    cpu_s: int = Field(10, ge=1, le=3600, description="CPU seconds per process (then SIGXCPU).")
    wall_s: float = Field(20.0, gt=0, le=3600, description="Wall seconds for one execution, tests included.")
    test_wall_s: float = Field(10.0, gt=0, le=3600, description="Wall seconds for one test.")
    memory_mib: int = Field(512, ge=64, description="Address space per process, MiB.")
    total_memory_mib: int = Field(
        1024, ge=64, description="Memory of all its processes and its /tmp together, MiB (a cgroup, where the "
        "host's memory controller can be used).")
    processes: int = Field(64, ge=4, le=4096, description="Processes and threads of the sandbox's user at once.")
    open_files: int = Field(64, ge=16, le=65536, description="Open files per process.")
    tmpfs_mib: int = Field(64, ge=1, le=65536, description="The only writable place, /tmp, MiB (files and all).")
    output_bytes: int = Field(1_048_576, ge=1024, description="Output past this on stdout or stderr ends it.")
    kept_bytes: int = Field(4096, ge=256, description="Of stdout and stderr each, what a verdict keeps.")
    workers: int | None = Field(
        None, ge=1, le=256, description="Sandbox workers of one RL run at most (they follow the queue's depth); "
        "unset: one per CPU core.")
    worker_idle_s: float = Field(5.0, gt=0, le=3600, description="A sandbox worker with no work ends after this.")


class RlSettings(Section):
    """Post-training from execution feedback (`appliance rl`): task sets, runs and their rewards."""

    IN_SUPERVISOR_CONFIG = False  # read by the programs from the settings file

    held_out_fraction: float = Field(0.2, ge=0, lt=1, description="Share of a task set's tasks held out.")
    efficiency_weight: float = Field(
        0.1, ge=0, le=1, description="Reward = share of tests passed, plus, for an answer passing them all, this "
        "times the share of its time limit left unused.")
    length_penalty: float = Field(
        0.0, ge=0, le=1, description="Reward less this times the share of max_tokens the answer used (0: "
        "length is not rewarded either way).")
    generation_concurrency: int = Field(4, ge=1, le=256, description="Requests to the gateway at once.")
    segment_attempts: int = Field(64, ge=1, description="Attempts per trajectory segment in the artifact store.")
    client_id: str = Field(
        "appliance-rl", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="The Keycloak client (a service account with role `user`) runs generate under.")
    gateway_timeout_s: float = Field(300.0, gt=0, description="One generation request, at most.")
    give_up_s: float = Field(
        600.0, gt=0, description="How long a generation is retried while the gateway or Keycloak refuse or are "
        "unreachable (429, 502-504) before the run fails.")
    worker_poll_s: float = Field(2.0, gt=0, description="How often the rl-worker looks for queued runs.")
    retry_s: float = Field(30.0, gt=0, description="How long a run waits before it resumes after the gateway, "
                           "Keycloak or the artifact store failed it.")
    episode_steps: int = Field(16, ge=1, le=1000, description="An agent's episode: the model's answers, at most.")
    episode_tool_calls: int = Field(
        64, ge=1, le=100_000, description="An episode's tool calls, at most (calls past it are not run).")
    episode_tokens: int = Field(16_384, ge=1, description="An episode's completion tokens, at most.")
    episode_wall_s: float = Field(600.0, gt=0, le=86_400, description="An episode's wall time, at most.")
    episode_answer_tokens: int = Field(512, ge=1, description="One answer's max_tokens in an episode.")
    workspace_mib: int = Field(
        64, ge=1, le=65536, description="An episode's workspace (a tmpfs the episode's tools share), MiB.")
    observation_bytes: int = Field(
        4096, ge=256, le=1 << 20, description="What a tool call's output may show the model, at most.")
