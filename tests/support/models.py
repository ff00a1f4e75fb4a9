"""Small models with random weights, and the model configs the planner tests read.

transformers annotates its model classes as untyped callables and `.to()` as taking a model, and
Qwen3MoeConfig's annotations lack keywords it accepts: hence the targeted type: ignores."""

from __future__ import annotations

import shutil
from pathlib import Path

MODEL_CONFIGS = Path(__file__).parent.parent / "data" / "model_configs"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def copy_tokenizer(source: Path, target: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, target / name)


def tiny_llama(target: Path, demo: Path) -> Path:
    """A 2-layer Llama with random weights and the demo model's tokenizer and chat template."""
    import torch  # heavy: only for the tests that build models
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(target)  # type: ignore[no-untyped-call]
    copy_tokenizer(demo, target)
    return target


def tiny_llama_for_two_ranks(target: Path, tokenizer_from: Path) -> Path:
    """2 layers, hidden 256, 4 attention and 2 KV heads of 64 (TP=2 splits both evenly); weights
    large enough (std 0.1) that greedy answers do not hinge on rounding."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = 0.1 * torch.randn_like(parameter)
            parameter.copy_(1 + noise if name.endswith("norm.weight") else noise)
    model.to(torch.bfloat16).save_pretrained(target)  # type: ignore[arg-type]
    copy_tokenizer(tokenizer_from, target)
    return target


def tiny_moe(target: Path, tokenizer_from: Path) -> Path:
    """A 4-expert, top-2 Qwen3-MoE with random weights (a few MB), with the demo model's tokenizer;
    head_dim 64, which the CPU engine's attention kernel serves (16 starts but fails on a request)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=2048,
                            tie_word_embeddings=False, torch_dtype="bfloat16")  # type: ignore[call-arg]
    moe = Qwen3MoeForCausalLM(config)  # type: ignore[no-untyped-call]
    moe.to(torch.bfloat16).save_pretrained(target, safe_serialization=True)  # type: ignore[arg-type]
    copy_tokenizer(tokenizer_from, target)
    return target


def random_adapter(demo: Path, out: Path) -> Path:
    """A LoRA adapter for the demo model with random (not identity) weights: servable, untrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
                   ).save_pretrained(str(out))
    return out
