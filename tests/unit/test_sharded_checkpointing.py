"""Gradient checkpointing in the sharded trainer: with it, a step's loss and LoRA gradients are
those without it (each decoder layer recomputes its forward in the backward pass, through FSDP2's
hooks), on a 2-layer Llama made here, in one gloo process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.jobs import Hyperparameters
from finetune.sharded import build_sharded, decoder_layers, train_step

ROWS = [([5, 9, 14, 3, 7, 11], [-100, -100, 14, 3, 7, 11]), ([8, 2, 6, 4], [-100, 2, 6, 4])]


@pytest.fixture(scope="module")
def process_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("store") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    target = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(target)  # type: ignore[no-untyped-call]
    return target


def one_step(base: Path, checkpointing: bool) -> tuple[float, dict[str, object], int]:
    """A step's loss, LoRA gradients, and how often the first layer's attention ran forward."""
    import torch

    hp = Hyperparameters(rank=4, alpha=8, dropout=0.0, seed=3)
    model = build_sharded(base, hp, torch.device("cpu"), checkpointing=checkpointing)
    model.train()
    forwards = []
    decoder_layers(model.get_base_model())[0].self_attn.register_forward_hook(lambda *_: forwards.append(1))
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    loss, _ = train_step(model, ROWS, 0, torch.device("cpu"), list(trainable.values()), 1)
    grads = {name: p.grad.full_tensor().clone() for name, p in trainable.items()}  # type: ignore[union-attr]
    return loss, grads, len(forwards)


def test_a_checkpointed_step_has_the_plain_step_s_loss_and_gradients(process_group: None, tiny: Path) -> None:
    import torch

    plain_loss, plain, plain_forwards = one_step(tiny, checkpointing=False)
    loss, grads, forwards = one_step(tiny, checkpointing=True)
    assert (plain_forwards, forwards) == (1, 2)  # recomputed in the backward pass
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert grads.keys() == plain.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(float(g.abs().sum()) > 0 for g in grads.values())  # type: ignore[attr-defined]


def test_a_saved_step_resumes_into_a_fresh_model_and_optimizer(process_group: None, tiny: Path,
                                                               tmp_path: Path) -> None:
    """Each rank saves and loads its own files (DCP without collectives): the adapter, AdamW's
    moments and step, and the random state come back as they were."""
    import torch

    from finetune import checkpoints

    def trained() -> tuple[object, object]:
        model = build_sharded(tiny, Hyperparameters(rank=4, alpha=8, dropout=0.0, seed=3), torch.device("cpu"))
        trainable = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.AdamW(trainable, lr=1e-2)

    model, optimizer = trained()
    train_step(model, ROWS, 0, torch.device("cpu"), [p for p in model.parameters() if p.requires_grad], 1)
    optimizer.step()  # type: ignore[attr-defined]
    checkpoints.save(tmp_path, 1, 42, model, optimizer)
    assert sorted(p.name for p in (tmp_path / "step-1").iterdir()) == ["manifest.json", "rank-0"]
    saved_model, saved_optimizer = checkpoints.adapter_state(model, optimizer)

    fresh, fresh_optimizer = trained()
    said: list[str] = []
    resumed = checkpoints.resume(tmp_path, fresh, fresh_optimizer, said.append)
    assert resumed is not None and (resumed.step, resumed.tokens) == (1, 42)
    assert said == ["resuming from checkpoint step-1 (step 1)"]
    loaded_model, loaded_optimizer = checkpoints.adapter_state(fresh, fresh_optimizer)
    for name, value in saved_model.items():
        torch.testing.assert_close(loaded_model[name].full_tensor(), value.full_tensor(), msg=name)
    def whole(tensor: object) -> object:
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    for name, state in saved_optimizer["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(whole(loaded_optimizer["state"][name][key]), whole(value), msg=f"{name} {key}")
