"""The engines: defaults for every vLLM pool, each pool, and the cluster network over which a pool
may span hosts."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, IPvAnyAddress

from appliance.settings.section import Port, Section
from appliance.tool_calling import ToolParser

DEMO_MODEL = "demo"


class EngineSettings(Section):
    """Defaults for every vLLM pool."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="cuda if an NVIDIA driver is present (auto), or force cpu/cuda."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = Field(
        None, description="Weight and activation dtype passed to vLLM --dtype (unset: bfloat16 on cuda; float32 "
        "on cpu, where vLLM's bfloat16 kernels on AMX hosts changed the demo model's greedy answers)."
    )
    max_model_len: int = Field(2048, gt=0, description="Longest sequence (prompt + output) in tokens.")
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of accelerator memory for vLLM (unset: 0.9 on cuda; on cpu 0.3 "
        "of the NUMA node's RAM, vLLM's default refuses to start on small hosts).",
    )
    cpu_kvcache_gib: int = Field(1, gt=0, description="KV-cache size on the CPU engine, GiB.")
    enforce_eager: bool | None = Field(
        None,
        description="Skip graph capture / torch.compile (unset: on for cpu, where it halves "
        "start-up; off for cuda).",
    )
    start_timeout_s: int = Field(
        600, gt=0, description="How long `appliance up` waits for an engine to answer."
    )
    yield_nice: int = Field(19, ge=0, le=19, description="While `up` starts the appliance, the programs the "
                            "engines do not need (Keycloak, its PostgreSQL, Prometheus, Alertmanager, the queue "
                            "workers) run at this CPU niceness, so that the engines load first where cores are few; "
                            "`up` returns them to 0 once all are ready (that needs root or CAP_SYS_NICE; `up` says if "
                            "it could not). 0: all start alike.")
    isolate_network: bool = Field(
        True, description="Run each engine in a network namespace of its own (loopback only): the ports "
        "vLLM opens inside (ZMQ, torch.distributed) are out of every other local process's reach; "
        "the engine is reached only through its Unix socket. Ranks of a pool spanning hosts cannot be: they "
        "talk to the other hosts' over the cluster network (see cluster)."
    )


class PoolSettings(Section):
    """One vLLM server: a model served under a name, on a Unix socket in the state dir's private
    run/engines/ (no TCP port: no other local user can reach the engine or take its place)."""

    name: str = Field(
        pattern=r"^[a-z][a-z0-9-]{0,30}$",
        description="Pool name; its supervised program is vllm-<name>.",
    )
    model: str = Field(
        DEMO_MODEL,
        description="'demo' (the bundled SmolLM2-135M-Instruct) or a path to an HF-format "
        "checkpoint directory.",
    )
    served_model_name: str | None = Field(
        None, description="Name clients use in 'model' (unset: the model directory's name)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM --tensor-parallel-size.")
    pipeline_parallel_size: int = Field(1, ge=1, description="vLLM --pipeline-parallel-size.")
    data_parallel_size: int = Field(1, ge=1, description="vLLM --data-parallel-size.")
    enable_expert_parallel: bool = Field(False, description="vLLM --enable-expert-parallel.")
    gpus: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="GPU indexes the pool holds on this host (unset: its plan's, else chosen from the free "
        "GPUs, TP groups inside one NVLink domain and NUMA node). Pools may not share GPUs."
    )
    tier: str | None = Field(
        None, pattern=r"^[a-z][a-z0-9-]{0,15}$",
        description="The tier of its model this pool serves (e.g. fast, full): pools serving one model name each "
        "name a tier of their own; clients ask for `MODEL:TIER`, or for `MODEL` and the routing policy picks."
    )
    replicas: int = Field(
        1, ge=1, le=32, description="Engines serving the pool side by side (vLLM data parallel as separate "
        "engines, programs vllm-<name>, vllm-<name>_1, ...); the gateway balances requests over them. With GPUs "
        "set, they are split among the replicas in order."
    )
    enable_lora: bool | None = Field(
        None, description="Serve LoRA adapters (runtime loading on), so that a trained adapter deploys without a "
        "restart; its cost is in docs/post-train/lora.md. Unset: on, except for a mixture-of-experts model on the "
        "CPU engine, whose vLLM LoRA kernels do not run there (its first request would fail)."
    )
    tool_parser: Literal["auto", "none"] | ToolParser = Field(
        "auto", description="OpenAI tool calling (`tool_choice` auto): vLLM's parser of the model's calls. auto: "
        "the one for the model's family where its template shows tools (docs/serve/tools.md); hermes for a ChatML "
        "model whose template does not also gives it the appliance's template that shows them; none: none.")
    max_lora_rank: int = Field(16, ge=1, description="Largest adapter rank accepted.")
    max_loras: int = Field(4, ge=1, description="Adapters resident at once.")
    max_model_len: int | None = Field(None, gt=0, description="Overrides engine.max_model_len.")
    plan: str | None = Field(
        None, description="A plan file (`appliance plan MODEL ... --json > FILE`): its TP/PP/DP/EP layout, "
        "context length and GPU sets replace the sizes above. A plan spanning hosts needs cluster.bind and its "
        "workers joined (`appliance hosts add`, `appliance join`)."
    )
    extra_args: list[str] = Field(
        default_factory=list, description="Further vLLM arguments, appended verbatim."
    )


class ClusterSettings(Section):
    """Pools that span hosts: the head's listener for workers joining (`appliance hosts add`, then
    `appliance join` on the worker), their heartbeats and weights. Off unless `bind` is set; the
    ranks of such pools talk over this network with vLLM's own (unauthenticated) channels, so it
    must be a dedicated, trusted cluster network."""

    bind: IPvAnyAddress | None = Field(
        None, description="Address on the cluster network the head listens on for workers (HTTPS, the "
        "appliance's own CA); unset: no pool may span hosts."
    )
    port: Port = Field(8443, description="Port of the head's cluster listener.")
    join_token_ttl_s: int = Field(3600, ge=60, le=7 * 86400, description="How long a join token is valid.")
    heartbeat_s: float = Field(0.2, gt=0, le=10, description="How often a worker reports its ranks.")
    dead_after_s: float = Field(
        1.0, gt=0, le=60, description="A worker silent this long is dead: its pools answer 503 until it is back."
    )
