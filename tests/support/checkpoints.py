"""Small safetensors checkpoints with Hugging Face tensor names, for staging and planning tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def llama(directory: Path, *, layers: int = 4, hidden: int = 64, vocab: int = 256, files: int = 3) -> Path:
    """A small Llama-shaped checkpoint with HF names, split over `files` shards with an index."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": vocab, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text("{}")
    generator = torch.Generator().manual_seed(0)
    kv = hidden // 2

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": weight(vocab, hidden), "model.norm.weight": weight(hidden),
               "lm_head.weight": weight(vocab, hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}"
        tensors |= {f"{prefix}.self_attn.q_proj.weight": weight(hidden, hidden),
                    f"{prefix}.self_attn.k_proj.weight": weight(kv, hidden),
                    f"{prefix}.self_attn.v_proj.weight": weight(kv, hidden),
                    f"{prefix}.self_attn.o_proj.weight": weight(hidden, hidden),
                    f"{prefix}.mlp.gate_proj.weight": weight(2 * hidden, hidden),
                    f"{prefix}.mlp.up_proj.weight": weight(2 * hidden, hidden),
                    f"{prefix}.mlp.down_proj.weight": weight(hidden, 2 * hidden),
                    f"{prefix}.input_layernorm.weight": weight(hidden),
                    f"{prefix}.post_attention_layernorm.weight": weight(hidden)}
    names = sorted(tensors)
    weight_map = {}
    for part in range(files):
        chosen = names[part::files]
        file = f"model-{part + 1:05d}-of-{files:05d}.safetensors"
        save_file({n: tensors[n] for n in chosen}, directory / file)
        weight_map |= {n: file for n in chosen}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory
