"""Greedy generation with vLLM's offline API, run as its own process by the sharded-state test:
each engine gets a fresh interpreter, so its worker processes and their memory end with it.

    python -P vllm_greedy.py MODEL_DIR OUT_JSON --tp N --load-format FORMAT [--dtype D] [--enable-expert-parallel]
        [--prompt P ...]

OUT_JSON gets, per prompt, the generated token ids and each step's top log-probabilities (no
prompt: the engine starts, its log says what it holds, and OUT_JSON gets an empty list).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MAX_TOKENS = 16
TOP_LOGPROBS = 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--load-format", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt", action="append", default=[], help="None: start the engine, answer nothing.")
    parser.add_argument("--enable-expert-parallel", action="store_true")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(model=str(args.model), tensor_parallel_size=args.tp, load_format=args.load_format,
              dtype=args.dtype, enforce_eager=True, max_model_len=512, gpu_memory_utilization=0.3, seed=0,
              enable_expert_parallel=args.enable_expert_parallel)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS, ignore_eos=True)
    results = []
    for output in llm.generate(args.prompt, params) if args.prompt else []:
        completion = output.outputs[0]
        steps = [{str(token): entry.logprob for token, entry in step.items()} for step in completion.logprobs or []]
        results.append({"prompt": output.prompt, "tokens": list(completion.token_ids), "logprobs": steps})
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
