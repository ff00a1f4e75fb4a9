"""The peer's side of bench/plan_compare.py, run with the python of llm-d-planner's own venv:
reads jobs (a config.json's fields, parameter counts by dtype, GPU memory, layout, context,
sequences) as JSON on stdin, and prints llm-d-planner's capacity figures for each: those its
`calculate_capacity` works out, from the same functions (it raises AttributeError on MLA models).

Nothing is fetched: every network connection is refused (and counted), the config is read from a
local directory by the peer's own `get_model_config_from_hf` (transformers' AutoConfig), and the
parameter counts it would read from the Hub's safetensors headers are the ones given.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

refused: list[str] = []
UTILIZATION = 0.9  # its default, and ours


def _refuse(*args: Any, **kwargs: Any) -> Any:
    refused.append(repr(args[1:] or args)[:200])
    raise OSError("plan_compare: the peer runs offline; no network")


socket.socket.connect = _refuse  # type: ignore[method-assign]
socket.socket.connect_ex = _refuse  # type: ignore[method-assign]
socket.create_connection = _refuse
socket.getaddrinfo = _refuse

import planner.capacity_planner as cp  # type: ignore[import-not-found]  # noqa: E402  (after the guard)


def load_config(directory: Path, fields: dict[str, Any]) -> tuple[Any, str]:
    """The config as the peer loads it; a model type transformers does not know (Kimi-K2's
    kimi_k2, remote code on the Hub) is built as its architecture's config instead."""
    try:
        return cp.get_model_config_from_hf(str(directory)), "AutoConfig.from_pretrained(local directory)"
    except ValueError:
        if fields.get("architectures") != ["DeepseekV3ForCausalLM"]:
            raise
        from transformers import AutoConfig
        config = AutoConfig.for_model("deepseek_v3", **{k: v for k, v in fields.items() if k != "model_type"})
        return config, f"AutoConfig.for_model('deepseek_v3') (model_type {fields.get('model_type')!r} is remote code)"


def capacity(model_id: str, config: Any, job: dict[str, Any]) -> dict[str, Any]:
    """The figures `calculate_capacity` (and the CLI's `plan`) work out for a layout, from the same
    functions, unrounded; a TP the model does not allow is refused as they refuse it."""
    tp, pp, dp, gib, context = job["tp"], job["pp"], job["dp"], job["gpu_gib"], job["context"]
    possible = cp.find_possible_tp(config)
    if tp not in possible:
        raise ValueError(f"Invalid tp value {tp}. Valid values for this model: {possible}")
    kv = cp.KVCacheDetail(model_id, config, context, job["concurrency"])
    return {
        "kv_per_token_bytes": kv.per_token_memory_bytes, "attention_type": str(kv.attention_type),
        "per_gpu_model_memory_gib": cp.per_gpu_model_memory_required(model_id, config, tp, pp),
        "allocatable_kv_cache_memory_gib": cp.allocatable_kv_cache_memory(
            model_id, config, gib, UTILIZATION, tp, pp, dp, max_model_len=context, batch_size=job["concurrency"]),
        "max_concurrent_requests": cp.max_concurrent_requests(model_id, config, context, gib, UTILIZATION,
                                                              batch_size=job["concurrency"], tp=tp, pp=pp, dp=dp),
        "activation_memory_gib": cp.estimate_vllm_activation_memory(config, tp=tp),
        "non_torch_memory_gib": cp.estimate_vllm_non_torch_memory(tp, pp),
        "cuda_graph_memory_gib": cp.estimate_vllm_cuda_graph_memory(),
        "available_gpu_memory_gib": cp.available_gpu_memory(gib, UTILIZATION),
        "check_model_fits_gpu": cp.check_model_fits_gpu(model_id, config, gib, UTILIZATION),
    }


def main() -> None:
    jobs = json.load(sys.stdin)
    work = Path(os.environ.get("PLAN_COMPARE_WORKDIR", "/tmp"))
    configs: dict[str, Any] = {}
    params: dict[str, dict[str, int]] = {}
    loaded_as: dict[str, str] = {}
    for job in jobs:
        directory = work / job["id"]
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(job["config"]))
        configs[str(directory)], loaded_as[job["id"]] = load_config(directory, job["config"])
        params[str(directory)] = job["params_by_dtype"]
    cp.get_model_config_from_hf = lambda name, token=None: configs[name]
    cp.model_params_by_dtype = lambda name, token=None: params[name]
    answers: dict[str, Any] = {}
    for job in jobs:
        model_id = str(work / job["id"])
        try:
            answer = capacity(model_id, configs[model_id], job)
        except ValueError as exc:
            answer = {"error": str(exc)}
        try:  # its API's entry point, for the record: it reads a field only GQA/MHA models set
            cp.calculate_capacity(model_id, max_model_len=job["context"], batch_size=job["concurrency"],
                                  gpu_memory=job["gpu_gib"], tp=job["tp"], pp=job["pp"], dp=job["dp"],
                                  gpu_mem_util=UTILIZATION, block_size=16)
            answer["calculate_capacity"] = "answered"
        except Exception as exc:  # recorded, not raised: the functions above answered
            answer["calculate_capacity"] = f"raised {type(exc).__name__}: {exc}"
        answer["config_loaded_as"] = loaded_as[job["id"]]
        answers[job["id"]] = answer
    print(json.dumps({"versions": {name: metadata.version(name) for name in
                                   ("llm-d-planner", "transformers", "huggingface_hub")},
                      "network_attempts": refused, "jobs": answers}, default=str))


if __name__ == "__main__":
    main()
