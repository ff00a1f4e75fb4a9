"""Two planners side by side: ours (`installer.planner.plan`) and llm-d-planner 0.3.3's capacity
planner, on six model and hardware cases read from config.json files alone, each answer beside an
arithmetic check computed here from the config.

Each case is planned at two layouts: the one our planner chooses, and TP = the GPUs of a host x
PP = the hosts (ours pinned to it). The peer takes its layout as an input (its GPU recommender,
which searches layouts, needs llm-optimizer, which is not on PyPI), so it is run at both; it gives
no verdict, so a layout fits for it when its sequences reach the case's target, as for ours.

The checks, per GPU of the fullest pipeline stage:
- weights = the fullest stage's parameters x bytes per parameter / TP (the stage's ceil(layers /
  PP) layers, routed experts also / DP under EP; embedding and head in 16 bits);
- KV bytes per token per rank: 2 x ceil(layers / PP) x max(1, KV heads // TP) x head_dim x 2 for
  standard attention; ceil(layers / PP) x (kv_lora_rank + qk_rope_head_dim) x 2 for MLA, which
  every TP rank holds whole;
- free KV memory = the planner's own budget less the checked weights less its own overheads
  (activations, CUDA graphs, NCCL and the like: each planner's estimate, not checked here), or 0;
- sequences = the checked free KV memory / the checked KV per token / the context, x DP.
An answer more than 5 % from its check is flagged.

The peer runs in a venv of its own (made on the first run with `python -m venv` and pip from the
registry) in a subprocess that refuses every network connection: its config comes from the local
file through transformers' AutoConfig, its parameter counts from the config (installer.memory's
count, in the checkpoint's dtypes) instead of the Hub's safetensors headers. Its side,
bench/plan_compare/peer.py, runs in that venv; nothing here imports it.

Run: .venv/bin/python -m bench.plan_compare [--peer-venv DIR]   Writes bench/results/plan_compare.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from appliance.records import Gpu, HardwareProfile, Host, Plan
from installer.memory import count_params
from installer.model_config import load_model_config
from installer.planner import Pins, PlanError, plan

ROOT = Path(__file__).parent.parent
CONFIGS = ROOT / "tests" / "data" / "model_configs"
RESULTS = Path(__file__).parent / "results" / "plan_compare.json"
PEER_DRIVER = Path(__file__).parent / "plan_compare" / "peer.py"
PEER_VENV = ROOT / ".cache" / "plan_compare" / "llmd-venv"
PEER_PACKAGE = "llm-d-planner[estimation]==0.3.3"
GIB = 1 << 30
GPUS_PER_HOST = 8
TOLERANCE = 0.05
FORMAT_BYTES = {"bf16": 2, "fp8": 1}
KV_DTYPE_BYTES = 2  # both planners: bf16 KV cache for these bf16-dtype configs
CHOSEN = "ours' choice"


@dataclass(frozen=True)
class Case:
    model: str  # tests/data/model_configs/<model>.json
    hosts: int
    gpu: str
    gib: int  # memory per GPU, as the peer's GPU catalog lists it; ours gets the same bytes
    context: int
    concurrency: int
    fmt: str  # weight format served: bf16 or fp8

    @property
    def label(self) -> str:
        return f"{self.model} {self.fmt}, {self.hosts}x{GPUS_PER_HOST} {self.gpu}-{self.gib}"


CASES = (
    Case("llama-3.1-405b", 2, "H100", 80, 32768, 16, "bf16"),
    Case("llama-3.1-70b", 1, "H100", 80, 32768, 16, "bf16"),
    Case("qwen3-235b-a22b", 1, "H100", 80, 32768, 16, "bf16"),
    Case("mixtral-8x22b", 1, "H100", 80, 32768, 16, "bf16"),
    Case("deepseek-v3", 1, "H200", 141, 32768, 16, "fp8"),
    Case("kimi-k2", 1, "H200", 141, 131072, 1, "fp8"),
)


class Shards(NamedTuple):
    tp: int
    pp: int
    dp: int = 1
    ep: bool = False

    def __str__(self) -> str:
        return f"TP{self.tp} PP{self.pp} DP{self.dp}" + (" EP" if self.ep else "")


# The arithmetic checks: pure, from the config and the parameter counts.

def kv_bytes_per_token_per_rank(config: dict[str, Any], shards: Shards, kv_bytes: int = KV_DTYPE_BYTES) -> int:
    """KV-cache bytes one token takes on one GPU of the fullest pipeline stage."""
    layers = math.ceil(int(config["num_hidden_layers"]) / shards.pp)
    if config.get("kv_lora_rank"):  # MLA: one latent per layer, no K/V pair, not split by TP
        return layers * (int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])) * kv_bytes
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return 2 * layers * max(1, kv_heads // shards.tp) * head_dim * kv_bytes


class ParamCounts(NamedTuple):
    """What the weights check needs of a model's parameter count."""

    embed: int
    lm_head: int
    dense_layer: int  # one dense layer: attention, norms, MLP
    moe_layer: int  # one MoE layer, its routed experts included
    moe_experts: int  # one MoE layer's routed experts
    dense_layers: int
    moe_layers: int


def param_counts(config_file: Path) -> ParamCounts:
    params = count_params(load_model_config(config_file))
    attention = params.layer_attention + params.layer_norms
    return ParamCounts(embed=params.embed, lm_head=params.lm_head, dense_layer=attention + params.layer_dense_mlp,
                       moe_layer=attention + params.routed * params.expert + params.layer_shared + params.layer_router,
                       moe_experts=params.routed * params.expert, dense_layers=params.dense_layers,
                       moe_layers=params.moe_layers)


def weight_bytes_per_gpu(params: ParamCounts, shards: Shards, linear_bytes: float, plain_bytes: int = 2) -> float:
    """The fullest pipeline stage's parameters x bytes per parameter / TP: its ceil(layers / PP)
    layers, MoE ones first (the heavier), with routed experts also over DP under EP; and the
    embedding and the head (both at PP 1, the larger otherwise), kept in 16 bits."""
    per_stage = math.ceil((params.dense_layers + params.moe_layers) / shards.pp)
    moe = min(per_stage, params.moe_layers)
    experts = params.moe_experts / (shards.dp if shards.ep else 1)
    layers = (per_stage - moe) * params.dense_layer + moe * (params.moe_layer - params.moe_experts + experts)
    edges = params.embed + params.lm_head if shards.pp == 1 else max(params.embed, params.lm_head)
    return (layers * linear_bytes + edges * plain_bytes) / shards.tp


def sequences(free_kv_bytes_per_gpu: float, kv_per_token: int, context: int, dp: int) -> int:
    """Whole sequences of `context` tokens the free KV memory of each replica holds, all replicas."""
    return int(free_kv_bytes_per_gpu // kv_per_token) // context * dp


def deviation(answer: float, check: float) -> float:
    """answer / check - 1; infinite where the check is 0 and the answer is not."""
    if check == 0:
        return 0.0 if answer == 0 else math.inf
    return answer / check - 1


def compared(answer: float | None, check: float | None) -> dict[str, Any]:
    """An answer beside its check, the deviation and whether it exceeds the tolerance."""
    if answer is None or check is None:
        return {"answer": answer, "check": check, "deviation": None, "flag": False}
    dev = deviation(answer, check)
    return {"answer": answer, "check": check, "deviation": round(dev, 4) if math.isfinite(dev) else None,
            "flag": round(abs(dev), 9) > TOLERANCE}  # rounded: 105 against 100 is 5 %, not more


# The two planners.

def profile(case: Case) -> HardwareProfile:
    return HardwareProfile(hosts=[
        Host(name=f"node-{h}", nvlink_all_to_all=True,
             gpus=[Gpu(index=g, name=case.gpu, memory_bytes=case.gib * GIB) for g in range(GPUS_PER_HOST)])
        for h in range(case.hosts)])


def ours(case: Case, pin: Shards | None) -> dict[str, Any]:
    """Our planner's answer: chosen freely (pin None) or at the pinned TP, PP and DP (EP its choice)."""
    pins = Pins() if pin is None else Pins(tp=pin.tp, pp=pin.pp, dp=pin.dp)
    try:
        record = plan(load_model_config(CONFIGS / f"{case.model}.json"), profile(case), context=case.context,
                      concurrency=case.concurrency, pins=pins, fmt=case.fmt)
    except PlanError as exc:
        return {"feasible": False, "shards": pin, "reason": f"refused: {exc}"}
    if not record.feasible or record.layout is None or record.per_gpu is None:
        return {"feasible": False, "shards": pin, "reason": _why_not(record, pin)}
    layout, memory = record.layout, record.per_gpu
    return {"feasible": True, "shards": Shards(layout.tp, layout.pp, layout.dp, layout.ep),
            "weights": memory.weights, "kv_per_token": record.kv_bytes_per_token, "free_kv": memory.kv_cache,
            "budget": memory.budget, "overhead": memory.reserve, "sequences": record.max_concurrent_sequences,
            "reason": f"holds {record.max_concurrent_sequences} sequences of {case.context:,}"}


def _why_not(record: Plan, pin: Shards | None) -> str:
    """Why our planner found no layout (the pinned one's rejection), and where one would fit."""
    smallest = record.smallest_fitting_hardware
    where = ""
    if smallest is not None:
        fits = smallest.layout
        where = f"; fits on {smallest.hosts} such hosts ({Shards(fits.tp, fits.pp, fits.dp, fits.ep)})"
    if pin is not None:
        for rejected in record.rejected:
            got = rejected.layout
            if (got.tp, got.pp, got.dp) == pin[:3]:
                return rejected.reason + where
    return "no layout fits" + where


def ensure_peer_venv(venv: Path) -> Path:
    """The peer venv's python, made and installed from the registry if absent."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"making the peer venv {venv} ({PEER_PACKAGE})", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", PEER_PACKAGE],
                       check=True)
    return python


def peer_params_by_dtype(case: Case) -> dict[str, int]:
    """The config's parameter count by checkpoint dtype, as the Hub's safetensors headers give it:
    an FP8 (block 128 x 128) checkpoint keeps embeddings, head, norms and routers in BF16, its
    linear weights in F8_E4M3 with an F32 scale per block."""
    params = count_params(load_model_config(CONFIGS / f"{case.model}.json"))
    if case.fmt == "bf16":
        return {"BF16": params.total}
    plain = (params.embed + params.lm_head + params.final_norm
             + (params.dense_layers + params.moe_layers) * params.layer_norms + params.moe_layers * params.layer_router)
    linear = params.total - plain
    return {"BF16": plain, "F8_E4M3": linear, "F32": math.ceil(linear / (128 * 128))}


def peer(python: Path, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The peer's answers for `jobs`, from its driver in a subprocess with no network and an
    empty Hugging Face home."""
    with tempfile.TemporaryDirectory(prefix="plan-compare-") as home:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "HF_HOME": f"{home}/hf",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
               "PLAN_COMPARE_WORKDIR": home}
        done = subprocess.run([str(python), "-I", str(PEER_DRIVER)], input=json.dumps(jobs), env=env,
                              capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the peer's driver failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def peer_row(case: Case, shards: Shards, answer: dict[str, Any]) -> dict[str, Any]:
    """The peer's answer for one case and layout (ours without EP: it has none), in our row's
    terms (bytes, per GPU)."""
    shards = shards._replace(ep=False)
    if "error" in answer:
        return {"feasible": False, "shards": shards, "reason": f"refused: {answer['error']}"}
    gpus = shards.tp * shards.pp * shards.dp
    free = answer["allocatable_kv_cache_memory_gib"] * GIB / gpus  # its figure is all GPUs together
    overhead = (answer["activation_memory_gib"] * shards.dp + (answer["non_torch_memory_gib"]
                + answer["cuda_graph_memory_gib"]) * gpus) * GIB / gpus
    fits = answer["max_concurrent_requests"]
    feasible = free > 0 and fits >= case.concurrency
    reason = (f"holds {fits} sequences of {case.context:,}" if free > 0 else "no memory left for the KV cache")
    return {"feasible": feasible, "shards": shards, "weights": round(answer["per_gpu_model_memory_gib"] * GIB),
            # per rank as its KV blocks and max_model_len are worked out: the whole model's / (TP x PP)
            "kv_per_token": round(answer["kv_per_token_bytes"] / (shards.tp * shards.pp), 1),
            "free_kv": round(free), "budget": round(answer["available_gpu_memory_gib"] * GIB),
            "overhead": round(overhead),
            "sequences": fits, "reason": reason, "tp_fitting_one_gpu_type": answer["check_model_fits_gpu"]}


def checked(case: Case, planner: str, source: str, answer: dict[str, Any]) -> dict[str, Any]:
    """A planner's answer for a case beside the arithmetic checks of its layout."""
    shards: Shards | None = answer.get("shards")
    row: dict[str, Any] = {"case": case.label, "model": case.model, "context": case.context,
                           "concurrency": case.concurrency, "planner": planner, "layout_source": source,
                           "layout": shards._asdict() if shards else None, "feasible": answer["feasible"],
                           "reason": answer.get("reason")}
    if "tp_fitting_one_gpu_type" in answer:
        row["tp_fitting_one_gpu_type"] = answer["tp_fitting_one_gpu_type"]
    if shards is None or "weights" not in answer:
        return row
    config_file = CONFIGS / f"{case.model}.json"
    weights = weight_bytes_per_gpu(param_counts(config_file), shards, FORMAT_BYTES[case.fmt])
    kv = kv_bytes_per_token_per_rank(json.loads(config_file.read_text()), shards)
    free = max(0.0, answer["budget"] - weights - answer["overhead"])
    row.update({
        "budget_per_gpu": answer["budget"], "overhead_per_gpu": answer["overhead"],
        "weights_per_gpu": compared(answer["weights"], round(weights)),
        "kv_bytes_per_token_per_rank": compared(answer["kv_per_token"], kv),
        "free_kv_per_gpu": compared(answer["free_kv"], round(free)),
        "max_sequences": compared(answer["sequences"], sequences(free, kv, case.context, shards.dp)),
    })
    return row


def layouts(case: Case) -> list[tuple[str, Shards | None, dict[str, Any]]]:
    """Our answers at our chosen layout and at TP = GPUs of a host x PP = hosts (pinned)."""
    full = Shards(GPUS_PER_HOST, case.hosts)
    chosen = ours(case, None)
    found: list[tuple[str, Shards | None, dict[str, Any]]] = [(CHOSEN, chosen.get("shards"), chosen)]
    if chosen.get("shards") is None or chosen["shards"][:3] != full[:3]:
        found.append((f"pinned {full}", full, ours(case, full)))
    return found


def peer_jobs(case: Case, shards: list[Shards]) -> list[dict[str, Any]]:
    config = json.loads((CONFIGS / f"{case.model}.json").read_text())
    return [{"id": f"{case.model}-{s.tp}-{s.pp}-{s.dp}", "config": config,
             "params_by_dtype": peer_params_by_dtype(case), "gpu_gib": case.gib, "tp": s.tp, "pp": s.pp,
             "dp": s.dp, "context": case.context, "concurrency": case.concurrency} for s in shards]


def _cell(cell: dict[str, Any] | None, show: Callable[[float], str] = lambda v: f"{round(v):,}") -> str:
    """An answer and its check; bold where they differ by more than the tolerance."""
    if not cell:
        return "-"
    answer, check = show(cell["answer"]), show(cell["check"])
    return f"**{answer}** ({check})" if cell["flag"] else f"{answer} ({check})"


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table, then why each layout that does not fit does not."""
    lines = ["| case | context, sequences | planner | layout | fits | weights / GPU, GiB (check) "
             "| KV B / token / rank (check) | free KV / GPU, GiB (check) | max sequences (check) |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for row in rows:
        layout = row["layout"]
        shown = (str(Shards(**layout)) if layout else "none") + ("" if row["layout_source"] == CHOSEN else " (pinned)")
        lines.append(f"| {row['case']} | {row['context'] // 1024}k, {row['concurrency']} | {row['planner']} "
                     f"| {shown} | {'yes' if row['feasible'] else 'no'} | {_cell(row.get('weights_per_gpu'), _gib)} "
                     f"| {_cell(row.get('kv_bytes_per_token_per_rank'))} | {_cell(row.get('free_kv_per_gpu'), _gib)} "
                     f"| {_cell(row.get('max_sequences'))} |")
        if not row["feasible"]:
            notes.append(f"- {row['case']}, {row['planner']}, {shown}: {row['reason']}")
    return "\n".join(lines + [""] + notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--peer-venv", type=Path, default=PEER_VENV, help="the peer's venv (made if absent)")
    args = parser.parse_args()
    python = ensure_peer_venv(args.peer_venv)
    planned = [(case, layouts(case)) for case in CASES]
    jobs = [job for case, found in planned for job in peer_jobs(case, [s for _, s, _ in found if s is not None])]
    answers = peer(python, jobs)
    rows: list[dict[str, Any]] = []
    for case, found in planned:
        for source, shards, our in found:
            rows.append(checked(case, "ours", source, our))
            if shards is not None:
                [job] = peer_jobs(case, [shards])
                rows.append(checked(case, "llm-d-planner", source, peer_row(case, shards, answers["jobs"][job["id"]])))
    table = markdown(rows)
    print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "bench": "plan_compare", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tolerance": TOLERANCE, "peer": {
            "versions": answers["versions"], "network_attempts": answers["network_attempts"],
            "config_loaded_as": {job_id: job["config_loaded_as"] for job_id, job in answers["jobs"].items()},
            "calculate_capacity": {job_id: job["calculate_capacity"] for job_id, job in answers["jobs"].items()},
            "params_by_dtype": {case.model: peer_params_by_dtype(case) for case in CASES}},
        "rows": rows, "table": table.splitlines()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
