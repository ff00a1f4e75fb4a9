#!/usr/bin/env bash
# The GPU check, for a lent GPU machine (the `device` tool; one H200, no network,
# 64 MiB carried with the working tree, 10 minutes a command). Run it there from the repo root:
#
#   here:   bench/gpu_check.sh --prepare      # wheels the device lacks -> .gpuwheels/ (git-ignored)
#   device: bash bench/gpu_check.sh           # with carry: [".gpuwheels"]; figures -> $OUT and bench/results/
#
# It records in bench/results/gpu-*.json (and $OUT, which the tool brings back):
#   gpu-profile.json     the NVML profile (installer.hardware.detect) and preflight's GPU checks
#   gpu-plan.json        the planner's predicted KV capacity for the demo model on this GPU, and the one
#                        vLLM reports when the CUDA engine is importable here
#   gpu-finetune-*.json  LoRA and QLoRA training tokens/s and peak GPU memory, appliance vs plain PEFT loop
#   gpu-engine.json      whether the CUDA engine and the whole appliance (Keycloak, gateway, audit) could
#                        run here, and the gateway's overhead against the GPU engine when they could
# Each step has its own time limit; one that cannot run records why instead of figures.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpuwheels
RESULTS=bench/results
# The device's python3 holds torch, transformers, peft, accelerate, nvidia-ml-py; these it lacks
# (at the lock's versions).
MISSING=$(grep -E '^(supervisor|bcrypt|cryptography|cffi|pycparser|pydantic|pydantic-core|annotated-types|typing-inspection|trl|datasets|dill|multiprocess|bitsandbytes|tomli-w)==' \
  requirements/lock.txt | cut -d' ' -f1)

if [ "${1:-}" = "--prepare" ]; then
  mkdir -p "$WHEELS"
  grep -qxF "/$WHEELS/" .git/info/exclude 2>/dev/null || echo "/$WHEELS/" >> .git/info/exclude
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$WHEELS" $MISSING || exit 1
  # The demo model's shape, tokenizer and chat template (4 MB; its weights, 269 MB, cannot travel):
  # the device makes random weights of that shape, which is all throughput and KV figures depend on.
  demo=$(.venv/bin/python -c 'from appliance.home import Home; print(Home.from_env().demo_model)')
  mkdir -p "$WHEELS/demo-shape"
  for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
    cp "$demo/$f" "$WHEELS/demo-shape/" || exit 1
  done
  du -sh "$WHEELS"
  echo "carry $WHEELS (must stay under 64 MiB with the working tree); the CUDA engine (vllm and its" \
       "CUDA extras, gigabytes) cannot travel this way: gpu-engine.json says so"
  exit 0
fi

OUT=${OUT:-$RESULTS}
# Batches of training rows per run: on a GPU a step of this small model takes milliseconds, so too
# few steps measure start-up (the first CUDA kernels) rather than training.
STEPS=${GPU_STEPS:-60}
mkdir -p "$RESULTS" "$OUT"
if [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
save() { cp "$RESULTS/$1" "$OUT/$1" 2>/dev/null || true; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, peft, accelerate, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__, 'trl', trl.__version__)"

echo "== profile (NVML) and preflight"
timeout 60 python3 - <<'PY' || echo '{"error": "profile failed"}' > "$RESULTS/gpu-profile.json"
import json
from pathlib import Path
from installer.hardware import detect
from installer.preflight import run_checks
profile = detect()
from appliance.engine_build import engine_cuda_version, installed_engine
checks = run_checks(profile, model_bytes=None, staging_dir=Path("/tmp"), ports=[], java_home=None, need_java=False,
                    engine=installed_engine(), engine_cuda=engine_cuda_version())
Path("bench/results/gpu-profile.json").write_text(json.dumps(
    {"profile": profile.model_dump(mode="json"), "checks": [c.model_dump() for c in checks if c.name.startswith(("gpu", "cuda", "mig", "engine"))]}, indent=1))
print(json.dumps(profile.hosts[0].model_dump(mode="json")["gpus"], indent=1))
PY
save gpu-profile.json

echo "== demo model (a tiny one made here when the bundled one is absent) and the planner's KV capacity"
timeout 180 python3 - <<'PY' || echo '{"error": "plan step failed"}' > "$RESULTS/gpu-plan.json"
import json, re, subprocess, sys
from pathlib import Path
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from installer.hardware import detect
from installer.model_config import load_model_config
from installer.planner import plan
model = Path("/tmp/gpu-check-model")
shape = Path(".gpuwheels/demo-shape")
if not (model / "model.safetensors").exists():
    torch.manual_seed(0)  # the demo model's shape, random weights: the figures depend on the shape only
    config = LlamaConfig.from_pretrained(shape) if shape.is_dir() else LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (shape / name).exists():
            (model / name).write_bytes((shape / name).read_bytes())
record = plan(load_model_config(model), detect(), context=8192, concurrency=1)
result = {"predicted_kv_tokens": record.kv_capacity_tokens, "layout": record.layout.model_dump() if record.layout else None}
try:
    import vllm  # noqa: F401  the CUDA engine, if it could be installed here
    log = subprocess.run([sys.executable, "-c", f"from vllm import LLM; LLM(model='{model}', max_model_len=8192, "
                          "gpu_memory_utilization=0.9, enforce_eager=True)"], capture_output=True, text=True, timeout=150)
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log.stdout + log.stderr)
    result["reported_kv_tokens"] = int(found[-1].replace(",", "")) if found else None
    result["ratio"] = round(result["predicted_kv_tokens"] / result["reported_kv_tokens"], 3) if found else None
except ImportError:
    result["reported_kv_tokens"] = None
    result["why"] = "vLLM (CUDA build) is not installed on this machine and cannot be carried (64 MiB)"
Path("bench/results/gpu-plan.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result, indent=1))
PY
save gpu-plan.json

for mode in lora qlora; do
  echo "== fine-tuning throughput: $mode (appliance vs plain PEFT loop)"
  flag=$([ "$mode" = qlora ] && echo --qlora || true)
  # shellcheck disable=SC2086
  if timeout 240 python3 bench/finetune_throughput.py --model /tmp/gpu-check-model --steps "$STEPS" $flag; then
    cp "$RESULTS/finetune_throughput.json" "$RESULTS/gpu-finetune-$mode.json"  # only a run that finished
  else
    echo "{\"error\": \"$mode run failed or timed out\"}" > "$RESULTS/gpu-finetune-$mode.json"
  fi
  save "gpu-finetune-$mode.json"
done

echo "== the CUDA engine and the whole appliance"
python3 - <<'PY'
import json, shutil
from pathlib import Path
try:
    import vllm  # noqa: F401
    engine = "importable"
except ImportError:
    engine = "not installed: the device reaches no index and carries at most 64 MiB; vLLM's CUDA build is gigabytes"
java = shutil.which("java")
result = {"cuda_engine": engine, "java_for_keycloak": java or "absent",
          "gateway_overhead": "not measured: needs the CUDA engine and Keycloak (Java) on this machine"
          if engine != "importable" or not java else "run bench/gateway_overhead.py --sections vllm"}
Path("bench/results/gpu-engine.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result, indent=1))
PY
save gpu-engine.json
ls -la "$OUT"
