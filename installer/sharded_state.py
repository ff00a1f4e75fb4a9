"""Pre-sharding a dense Hugging Face checkpoint into vLLM's `--load-format sharded_state` layout,
one tensor-parallel rank at a time, without building the model.

vLLM's own saver (`ShardedStateLoader.save_model`) needs the whole model loaded on the target
devices, and on the CPU it cannot work at all: after loading, the CPU GEMM dispatch replaces each
linear weight with an empty tensor, which the saver then drops. So the rank files are written
here from the source safetensors, reproducing exactly the state dict vLLM 0.32's loader expects
(`ShardedStateLoader.load_weights`: every key of `_filter_subtensors(model.state_dict())`, no
other key, each tensor of the parameter's shape):

- fused names: `self_attn.qkv_proj` is [q; k; v] of this rank's heads, `mlp.gate_up_proj` is
  [gate; up] of this rank's rows (`QKVParallelLinear`, `MergedColumnParallelLinear`);
- `o_proj` and `down_proj` keep this rank's input columns (`RowParallelLinear`); their biases
  are whole on every rank;
- with fewer KV heads than ranks, rank r holds KV head r // (tp / kv_heads) (replication);
- the vocabulary is padded to a multiple of 64, split evenly, and each rank's rows past the real
  vocabulary are zeros (`VocabParallelEmbedding`, `ParallelLMHead`);
- tied embeddings are one tensor named `lm_head.weight` (the saver keeps the smaller name of two
  that share storage);
- every attention layer carries four float32 scalar buffers (`attn._k_scale`, `_v_scale`,
  `_q_scale`, `_prob_scale`, all 1.0 unquantized) that vLLM registers in its state dict, so the
  loader reports them missing unless they are written.

Nothing is decoded: each part is streamed, its header first, then each tensor's bytes (row
slices copied in the kernel, column slices cut from bounded blocks of rows), so memory stays a
few chunks whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy

from appliance.errors import ApplianceError
from appliance.records import config_sha256
from installer.model_config import ModelConfigError, ModelShape, parse_config, read_config_file
from installer.safetensors_bytes import (
    CHUNK,
    DTYPE_BYTES,
    SafetensorsFileError,
    build_header,
    copy_range,
    read_header,
    write_all,
)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
PART_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Source files that describe the source's own bytes, wrong beside the shards: the appliance's
# per-file SHA-256 list (installer.demo_model writes one into the demo model).
SOURCE_ONLY_FILES = frozenset({INDEX_FILE, "manifest.json"})
# vLLM's DEFAULT_VOCAB_PADDING_SIZE (vllm/model_executor/layers/vocab_parallel_embedding.py).
VOCAB_PADDING = 64
# Buffers vLLM's Attention registers per layer (set_default_quant_scales, register_buffer=True).
ATTENTION_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
# Tensors some checkpoints carry that vLLM recomputes and never loads.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# config.json dtype -> safetensors dtype
DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


class ShardingError(ApplianceError):
    """A checkpoint cannot be pre-sharded for vLLM's sharded_state loader."""


@dataclass(frozen=True, kw_only=True)
class DenseConfig(ModelShape):
    """The model's shape (installer.model_config declares it) as vLLM's model classes read
    config.json: head size, q/k/v bias and q/k norms per family, and the biases only they read."""

    source: Path  # config.json, named in errors
    o_bias: bool
    mlp_bias: bool

    @property
    def tensor_dtype(self) -> str:
        """Its dtype as safetensors names it: BF16, F16, F32."""
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Slice:
    """Rows or columns [start, stop) of one source tensor (`dim` 0 or 1)."""

    tensor: str
    dim: int = 0
    start: int = 0
    stop: int | None = None  # None: to the end


@dataclass(frozen=True)
class _Bytes:
    """Where a source tensor's bytes are: absolute offsets in its file, shape, dtype."""

    start: int
    end: int
    shape: list[int]
    dtype: str


@dataclass(frozen=True)
class RankTensor:
    """One tensor of a rank's state dict: source slices stacked on dim 0, with zero rows after
    them up to `shape` (vocabulary padding), or, without slices, float32 `fill` (the scales)."""

    name: str
    shape: tuple[int, ...]
    slices: tuple[Slice, ...] = ()
    fill: float = 0.0

    def nbytes(self, dtype: str) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[dtype if self.slices else "F32"]


def read_config(model_dir: Path) -> DenseConfig:
    """config.json read the way vLLM 0.32's Llama/Qwen2/Qwen3 classes read it."""
    file = model_dir / "config.json"
    raw = read_config_file(file, ShardingError, hint="give a Hugging Face checkpoint directory")
    architectures = raw.get("architectures") or [None]
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ShardingError(
            f"{file}: architectures: {architecture!r} cannot be pre-sharded",
            hint=f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}; stage other models with --format subset")
    if raw.get("quantization_config") is not None:
        raise ShardingError(f"{file}: quantization_config: quantized checkpoints have other parameters "
                            "than the dense layout this writes", hint="stage it with --format subset")
    try:
        # A null field (transformers writes "head_dim": null) means "derive it", as vLLM reads it.
        shape = parse_config({k: v for k, v in raw.items() if v is not None}, name=model_dir.name, source=str(file))
    except ModelConfigError as exc:
        raise ShardingError(exc.message, hint=exc.hint) from exc
    read = {field.name: getattr(shape, field.name) for field in fields(shape)}
    read["config_sha256"] = config_sha256(raw)  # the file's identity, as the planner's: nulls and all
    return DenseConfig(**read | _family_traits(architecture, raw, shape.head_dim, shape.hidden // shape.heads),
                       source=file)


def _family_traits(architecture: str, raw: dict[str, Any], head_dim: int, derived_head_dim: int) -> dict[str, Any]:
    """Head size, biases and norms, per family: each vLLM class reads different config keys."""
    if architecture == "LlamaForCausalLM":
        # LlamaDecoderLayer: attention_bias (or bias) for q/k/v/o, qkv_bias overriding q/k/v.
        attention_bias = bool(raw.get("attention_bias") or raw.get("bias"))
        return {"head_dim": head_dim, "qkv_bias": bool(raw.get("qkv_bias", attention_bias)),
                "o_bias": attention_bias, "mlp_bias": bool(raw.get("mlp_bias")), "qk_norm": False}
    if architecture == "Qwen2ForCausalLM":
        # Qwen2Attention ignores config.head_dim and always has a q/k/v bias.
        return {"head_dim": derived_head_dim, "qkv_bias": True, "o_bias": False, "mlp_bias": False,
                "qk_norm": bool(raw.get("qk_norm"))}
    return {"head_dim": head_dim, "qkv_bias": bool(raw.get("attention_bias")), "o_bias": False,
            "mlp_bias": False, "qk_norm": True}


def source_shapes(config: DenseConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the Hugging Face checkpoint must hold, with the shape config.json implies."""
    h, d, q, kv, inter = config.hidden, config.head_dim, config.heads * config.head_dim, \
        config.kv_heads * config.head_dim, config.intermediate
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab, h), "model.norm.weight": (h,)}
    if not config.tied_embeddings:
        shapes["lm_head.weight"] = (config.vocab, h)
    for i in range(config.layers):
        p = f"model.layers.{i}."
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                 "mlp.down_proj.weight": (h, inter)}
        if config.qkv_bias:
            layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
        if config.o_bias:
            layer["self_attn.o_proj.bias"] = (h,)
        if config.mlp_bias:
            layer |= {"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,), "mlp.down_proj.bias": (h,)}
        if config.qk_norm:
            layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        shapes |= {p + name: shape for name, shape in layer.items()}
    return shapes


def check_tp(config: DenseConfig, tp_size: int) -> None:
    """Raise unless vLLM can split this model `tp_size` ways (its layers assert the same)."""
    where = config.source
    if tp_size < 1:
        raise ShardingError(f"tensor-parallel size {tp_size} must be at least 1")
    if config.heads % tp_size:
        raise ShardingError(f"{where}: num_attention_heads {config.heads} is not divisible by tensor-parallel "
                            f"size {tp_size}", hint="pick a TP size that divides the attention heads")
    if config.kv_heads % tp_size and tp_size % config.kv_heads:
        raise ShardingError(f"{where}: num_key_value_heads {config.kv_heads} neither divides nor is a multiple "
                            f"of tensor-parallel size {tp_size}")
    if config.intermediate % tp_size:
        raise ShardingError(f"{where}: intermediate_size {config.intermediate} is not divisible by "
                            f"tensor-parallel size {tp_size}")
    if padded_vocab(config.vocab) % tp_size:
        raise ShardingError(f"{where}: vocab_size {config.vocab} padded to {padded_vocab(config.vocab)} is not "
                            f"divisible by tensor-parallel size {tp_size}")


def padded_vocab(vocab: int) -> int:
    """The vocabulary rows vLLM allocates over all ranks (pad_vocab_size)."""
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def rank_tensors(config: DenseConfig, tp_size: int, rank: int) -> list[RankTensor]:
    """Rank `rank`'s state dict, in vLLM's module order: names, shapes and where each comes from."""
    check_tp(config, tp_size)
    if not 0 <= rank < tp_size:
        raise ShardingError(f"rank {rank} is outside tensor-parallel size {tp_size}")
    vocab = _vocab_tensor(config, tp_size, rank)
    tensors = [] if config.tied_embeddings else [RankTensor("model.embed_tokens.weight", vocab.shape,
                                                 (Slice("model.embed_tokens.weight", 0, *vocab.rows),))]
    for i in range(config.layers):
        tensors += _layer_tensors(config, tp_size, rank, f"model.layers.{i}.")
    tensors.append(RankTensor("model.norm.weight", (config.hidden,), (Slice("model.norm.weight"),)))
    # Tied: one parameter under two names; vLLM keeps the smaller one, lm_head.weight.
    head_source = "model.embed_tokens.weight" if config.tied_embeddings else "lm_head.weight"
    tensors.append(RankTensor("lm_head.weight", vocab.shape, (Slice(head_source, 0, *vocab.rows),)))
    return tensors


@dataclass(frozen=True)
class _VocabShard:
    shape: tuple[int, ...]
    rows: tuple[int, int]  # real vocabulary rows this rank holds; the rest of `shape[0]` is zeros


def _vocab_tensor(config: DenseConfig, tp_size: int, rank: int) -> _VocabShard:
    per_rank = padded_vocab(config.vocab) // tp_size
    start = min(rank * per_rank, config.vocab)
    return _VocabShard((per_rank, config.hidden), (start, min(start + per_rank, config.vocab)))


def _layer_tensors(config: DenseConfig, tp_size: int, rank: int, p: str) -> list[RankTensor]:
    h, d = config.hidden, config.head_dim
    q_rows = config.heads // tp_size * d
    # Fewer KV heads than ranks: each KV head is replicated on tp / kv_heads consecutive ranks.
    kv_rows = max(1, config.kv_heads // tp_size) * d
    kv_index = rank // max(1, tp_size // config.kv_heads)
    inter = config.intermediate // tp_size
    attn, mlp = p + "self_attn.", p + "mlp."

    def rows(name: str, index: int, size: int) -> Slice:
        return Slice(name, 0, index * size, (index + 1) * size)

    def qkv(kind: str) -> tuple[Slice, ...]:
        return (rows(f"{attn}q_proj.{kind}", rank, q_rows), rows(f"{attn}k_proj.{kind}", kv_index, kv_rows),
                rows(f"{attn}v_proj.{kind}", kv_index, kv_rows))

    qkv_out = q_rows + 2 * kv_rows
    tensors = [RankTensor(p + "input_layernorm.weight", (h,), (Slice(p + "input_layernorm.weight"),)),
               RankTensor(attn + "qkv_proj.weight", (qkv_out, h), qkv("weight"))]
    if config.qkv_bias:
        tensors.append(RankTensor(attn + "qkv_proj.bias", (qkv_out,), qkv("bias")))
    tensors.append(RankTensor(attn + "o_proj.weight", (h, q_rows),
                              (Slice(attn + "o_proj.weight", 1, rank * q_rows, (rank + 1) * q_rows),)))
    if config.o_bias:
        tensors.append(RankTensor(attn + "o_proj.bias", (h,), (Slice(attn + "o_proj.bias"),)))
    if config.qk_norm:
        tensors += [RankTensor(attn + f"{norm}.weight", (d,), (Slice(attn + f"{norm}.weight"),))
                    for norm in ("q_norm", "k_norm")]
    tensors += [RankTensor(attn + "attn." + scale, (), fill=1.0) for scale in ATTENTION_SCALES]
    tensors += [RankTensor(p + "post_attention_layernorm.weight", (h,),
                           (Slice(p + "post_attention_layernorm.weight"),)),
                RankTensor(mlp + "gate_up_proj.weight", (2 * inter, h),
                           (rows(mlp + "gate_proj.weight", rank, inter), rows(mlp + "up_proj.weight", rank, inter)))]
    if config.mlp_bias:
        tensors.append(RankTensor(mlp + "gate_up_proj.bias", (2 * inter,),
                                  (rows(mlp + "gate_proj.bias", rank, inter), rows(mlp + "up_proj.bias", rank, inter))))
    tensors.append(RankTensor(mlp + "down_proj.weight", (h, inter),
                              (Slice(mlp + "down_proj.weight", 1, rank * inter, (rank + 1) * inter),)))
    if config.mlp_bias:
        tensors.append(RankTensor(mlp + "down_proj.bias", (h,), (Slice(mlp + "down_proj.bias"),)))
    return tensors


class _Source:
    """The checkpoint's tensors by name and where their bytes are, from each file's header (read
    once); errors name file and tensor."""

    def __init__(self, model_dir: Path, config: DenseConfig, stack: ExitStack) -> None:
        self._layouts: dict[Path, dict[str, _Bytes]] = {}
        index = model_dir / INDEX_FILE
        # Where a missing tensor should have been: the index, else the directory.
        self.where = index if index.exists() else model_dir
        self.files = self._locate(model_dir)
        self._check(config)
        # Opened here, once, so threads writing parts share them (reads give their own offsets).
        self._fds = {path: stack.enter_context(path.open("rb")).fileno() for path in set(self.files.values())}

    def _locate(self, model_dir: Path) -> dict[str, Path]:
        """Tensor name -> file, from the index when there is one (it names the files that must exist)."""
        index = model_dir / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ShardingError(f"{index}: not a readable safetensors index ({exc})") from exc
            files = {name: model_dir / file for name, file in weight_map.items()}
            for name, path in files.items():
                if not path.is_file():
                    raise ShardingError(f"{index}: {name}: its file {path.name} is missing",
                                        hint="copy the whole checkpoint")
            return files
        paths = sorted(model_dir.glob("*.safetensors"))
        if not paths:
            raise ShardingError(f"{model_dir}: no *.safetensors files", hint="give a safetensors checkpoint")
        return {name: path for path in paths for name in self._layout(path)}

    def _check(self, config: DenseConfig) -> None:
        """Every expected tensor present with config.json's shape and dtype; nothing vLLM would lack."""
        expected = source_shapes(config)
        for name, shape in expected.items():
            if name not in self.files:
                raise ShardingError(f"{self.where}: tensor {name} is missing from the checkpoint",
                                    hint="copy the whole checkpoint")
            layout = self._layout(self.files[name]).get(name)
            if layout is None:
                raise ShardingError(f"{self.files[name]}: tensor {name} is not in this file (the index puts it there)")
            found = tuple(layout.shape)
            if found != shape:
                raise ShardingError(f"{self.files[name]}: tensor {name} has shape {list(found)}, "
                                    f"{config.source.name} implies {list(shape)}")
            dtype = layout.dtype
            if config.tensor_dtype != dtype:
                raise ShardingError(f"{self.files[name]}: tensor {name} is {dtype}, "
                                    f"{config.source.name} says {config.tensor_dtype}")
        for name, path in self.files.items():
            tied_head = config.tied_embeddings and name == "lm_head.weight"
            if name not in expected and not tied_head and not name.endswith(IGNORED_SUFFIXES):
                raise ShardingError(f"{path}: tensor {name} has no parameter in vLLM's {config.architecture}",
                                    hint="the checkpoint does not match its config.json")

    def copy(self, piece: Slice, out: int) -> int:
        """Append the piece's bytes to `out`; returns how many. Rows (or all columns) are one byte
        range, copied in the kernel; some columns are cut from blocks of whole rows, CHUNK bytes at
        a time."""
        path = self.files[piece.tensor]
        fd, layout = self._fds[path], self._layout(path)[piece.tensor]
        start, shape, item = layout.start, layout.shape, DTYPE_BYTES[layout.dtype]
        rows = shape[0] if shape else 1
        row_bytes = item * math.prod(shape[1:])
        stop = shape[piece.dim] if piece.stop is None else piece.stop
        if piece.dim == 1 and (piece.start, stop) == (0, shape[1]):  # every column: the whole tensor
            piece, stop = Slice(piece.tensor), rows
        if piece.dim == 0:
            length = (stop - piece.start) * row_bytes
            copy_range(fd, out, start + piece.start * row_bytes, length)
            return length
        columns = slice(piece.start * item, stop * item)
        block = max(1, CHUNK // row_bytes)
        for first in range(0, rows, block):
            count = min(block, rows - first)
            raw = os.pread(fd, count * row_bytes, start + first * row_bytes)
            if len(raw) < count * row_bytes:
                raise ShardingError(f"{path}: tensor {piece.tensor}: the file ends inside it")
            rows_read = numpy.frombuffer(raw, numpy.uint8).reshape(count, row_bytes)
            write_all(out, rows_read[:, columns].tobytes())
        return rows * (columns.stop - columns.start)

    def _layout(self, path: Path) -> dict[str, _Bytes]:
        """Tensor name -> where its bytes are in a source file; a file shorter than its header
        says is refused here, before anything is written."""
        if path not in self._layouts:
            try:
                header, base = read_header(path)
                layout = {name: _Bytes(base + entry["data_offsets"][0], base + entry["data_offsets"][1],
                                       list(entry["shape"]), entry["dtype"])
                          for name, entry in header.items() if name != "__metadata__"}
            except (SafetensorsFileError, KeyError, TypeError, IndexError) as exc:
                raise ShardingError(f"{path}: not a readable safetensors file ({exc})",
                                    hint="re-copy the checkpoint file") from exc
            size = path.stat().st_size
            needs = max((where.end for where in layout.values()), default=0)
            if needs > size:
                raise ShardingError(f"{path}: not a readable safetensors file (truncated: {size:,} bytes, its "
                                    f"header needs {needs:,})", hint="re-copy the checkpoint file")
            self._layouts[path] = layout
        return self._layouts[path]


def _write_part(path: Path, group: list[RankTensor], source: _Source, dtype: str,
                progress: Callable[[int], None] | None) -> None:
    """A part file streamed tensor by tensor: the header, then each tensor's source slices
    stacked, zero rows after them (vocabulary padding), or its float32 fill (the scales)."""
    header = build_header(((spec.name, dtype if spec.slices else "F32", list(spec.shape), spec.nbytes(dtype))
                           for spec in group), metadata={"format": "pt"})
    with path.open("wb", buffering=0) as handle:
        out = handle.fileno()
        write_all(out, header)
        for spec in group:
            size = spec.nbytes(dtype)
            if spec.slices:
                written = sum(source.copy(piece, out) for piece in spec.slices)
                _write_zeros(out, size - written)
            else:
                write_all(out, struct.pack("<f", spec.fill) * math.prod(spec.shape))
            if progress is not None:
                progress(size)


def _write_zeros(out: int, count: int) -> None:
    zeros = bytes(min(count, CHUNK))
    while count:
        write_all(out, memoryview(zeros)[:min(count, CHUNK)])
        count -= min(count, CHUNK)


def _parts(specs: list[RankTensor], dtype: str, max_part_bytes: int) -> Iterator[list[RankTensor]]:
    """Consecutive groups of at most max_part_bytes (a bigger tensor alone), as vLLM's saver groups."""
    group: list[RankTensor] = []
    size = 0
    for spec in specs:
        nbytes = spec.nbytes(dtype)
        if group and size + nbytes > max_part_bytes:
            yield group
            group, size = [], 0
        group.append(spec)
        size += nbytes
    if group:
        yield group


def write_rank(model_dir: Path, out_dir: Path, *, tp_size: int, rank: int, max_part_bytes: int = 2 << 30,
               progress: Callable[[int], None] | None = None,
               seal: Callable[[Path, Path], None] = lambda tmp, path: _fsync(tmp)) -> list[Path]:
    """Write rank `rank`'s files model-rank-{rank}-part-{part}.safetensors into out_dir (each
    written to a temporary name and renamed when complete), return their paths in order.

    Everything is checked (config, TP split, every source tensor's presence, shape and dtype)
    before the first byte is written. Older parts of this rank beyond the new count are removed,
    since vLLM loads every file matching the rank's pattern. `progress` gets the bytes of each
    tensor once it is written; `seal(tmp, path)` makes each part durable before it takes its name
    (by default an fsync; staging also hashes it there).
    """
    config = read_config(model_dir)
    specs = rank_tensors(config, tp_size, rank)
    if out_dir.resolve() == model_dir.resolve():
        raise ShardingError(f"{out_dir}: the output directory is the checkpoint itself",
                            hint="write the shards to another directory")
    with ExitStack() as stack:
        source = _Source(model_dir, config, stack)
        out_dir.mkdir(parents=True, exist_ok=True)

        def write(numbered: tuple[int, list[RankTensor]]) -> Path:
            part, group = numbered
            path = out_dir / PART_PATTERN.format(rank=rank, part=part)
            with _atomic(path) as tmp:
                _write_part(tmp, group, source, config.tensor_dtype, progress)
                seal(tmp, path)
            return path

        # Two parts at a time: one is copied while the other is hashed and flushed.
        with ThreadPoolExecutor(max_workers=2) as pool:
            written = list(pool.map(write, enumerate(_parts(specs, config.tensor_dtype, max_part_bytes))))
    for stale in out_dir.glob(PART_PATTERN.format(rank=rank, part="*")):
        if stale not in written:
            stale.unlink()
    return written


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


@contextmanager
def _atomic(path: Path) -> Iterator[Path]:
    """A temporary name beside `path` that becomes `path` only if the block completes."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def copy_side_files(model_dir: Path, out_dir: Path) -> list[Path]:
    """Copy what vLLM reads beside the weights (config.json, generation_config.json, tokenizer
    files, chat template, ...): every top-level file that is not a *.safetensors weight file, the
    index or the source's manifest. Returns the copies' paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    copies = []
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or path.suffix == ".safetensors" or path.name in SOURCE_ONLY_FILES:
            continue
        target = out_dir / path.name
        with _atomic(target) as tmp:
            shutil.copyfile(path, tmp)
        copies.append(target)
    return copies
