"""Stage a checkpoint for a plan: for each host, exactly the tensors its ranks need (its pipeline
stages' layers, embeddings on the first stage, final norm and head on the last, only its experts
when expert parallelism spreads them over hosts), copied byte-exact from the source safetensors.

Streaming: tensors are never decoded; each output file is a new safetensors header followed by
byte ranges copied from the source with `os.copy_file_range` (in the kernel), so memory stays
small whatever the checkpoint's size. Each output file is written under a temporary name, its
SHA-256 taken while it is fsynced, then renamed and recorded in the manifest, so a killed run resumes after the last
finished file. Files are staged in parallel (the copy and the hash both leave the GIL).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypedDict, TypeVar

from appliance.durable import replace_file
from appliance.errors import ApplianceError
from appliance.records import STAGING_MANIFEST, Plan
from appliance.staging_manifest import RankFiles, ShardPart, StagingManifest, SubsetFile, TensorSource
from installer.model_config import ModelShape, load_model_config
from installer.safetensors_bytes import DTYPE_BYTES, SafetensorsFileError, build_header, copy_range, read_header
from installer.sharded_state import copy_side_files, write_rank

T = TypeVar("T")
MANIFEST = STAGING_MANIFEST
INDEX = "model.safetensors.index.json"
HASH_CHUNK = 8 << 20
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
EXPERT = re.compile(r"\.experts\.(\d+)\.")
FIRST_STAGE = ("embed_tokens",)
LAST_STAGE = ("lm_head", "model.norm.")


class StagingError(ApplianceError):
    """The checkpoint, the plan or a staged directory is not what it should be."""


class _PartDigests(TypedDict):
    """A sharded part's SHA-256, as its ShardPart entry in the staging manifest holds them."""

    header_sha256: str
    tensor_sha256: dict[str, str]


@dataclass(frozen=True)
class SourceTensor:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


# -- the source ----------------------------------------------------------------------------


def read_source(model_dir: Path) -> dict[str, SourceTensor]:
    """Every tensor of the checkpoint and where its bytes are; a missing shard (named by the
    index) or a file shorter than its header says is an error naming the file and tensor."""
    files = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        for name, file in sorted(weight_map.items()):
            if not (model_dir / file).is_file():
                raise StagingError(f"{model_dir / file}: missing shard (the index puts {name} there)")
    if not files:
        raise StagingError(f"{model_dir}: no *.safetensors files")
    tensors: dict[str, SourceTensor] = {}
    for path in files:
        header, base = read_header(path)
        size = path.stat().st_size
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, end = (base + offset for offset in entry["data_offsets"])
            dtype, shape = entry["dtype"], tuple(entry["shape"])
            if end > size:
                raise StagingError(f"{path}: truncated: tensor {name} ends at byte {end:,} of {size:,}")
            expected = DTYPE_BYTES.get(dtype, 0) * math.prod(shape)
            if expected and expected != end - start:
                raise StagingError(f"{path}: tensor {name}: {dtype} {list(shape)} needs {expected:,} bytes, "
                                   f"the header gives {end - start:,}")
            tensors[name] = SourceTensor(name, path, dtype, shape, start, end)
    return tensors


def check_against_config(tensors: dict[str, SourceTensor], model: ModelShape) -> None:
    """The checkpoint is the model its config describes (embeddings, layer count, dtype)."""
    embed = next((t for n, t in tensors.items() if n.endswith("embed_tokens.weight")), None)
    if embed is None:
        raise StagingError(f"{model.name}: no embed_tokens.weight tensor in the checkpoint")
    if embed.shape != (model.vocab, model.hidden):
        raise StagingError(f"{embed.file}: tensor {embed.name}: shape {list(embed.shape)} disagrees with "
                           f"config.json (vocab_size {model.vocab}, hidden_size {model.hidden})")
    expected_dtype = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[model.dtype]
    if embed.dtype != expected_dtype:
        raise StagingError(f"{embed.file}: tensor {embed.name}: dtype {embed.dtype} disagrees with config.json "
                           f"torch_dtype {model.dtype}")
    layers = {int(m.group(1)) for n in tensors if (m := LAYER.search(n))}
    missing = sorted(set(range(model.layers)) - layers)
    if missing:
        raise StagingError(f"{model.name}: layers {missing[:5]} of the {model.layers} config.json declares have "
                           "no tensors in the checkpoint")


def config_sha256(model_dir: Path) -> str:
    return load_model_config(model_dir).config_sha256


# -- what each host needs --------------------------------------------------------------------


@dataclass(frozen=True)
class HostShare:
    host: str
    layers: range  # the layers of its pipeline stages
    first_stage: bool
    last_stage: bool
    experts: range | None  # None: every expert


def pp_layers(layers: int, pp: int) -> list[range]:
    """vLLM's split: layers // pp each, the remainder added to the second-to-last stage, then
    the third-to-last, never the last (or VLLM_PP_LAYER_PARTITION when set)."""
    partition = os.environ.get("VLLM_PP_LAYER_PARTITION")
    if partition:
        sizes = [int(part) for part in partition.split(",")]
    else:
        sizes = [layers // pp] * pp
        for i in range(2, layers % pp + 2):
            sizes[-i] += 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append(range(start, start + size))
        start += size
    return bounds


def host_shares(plan: Plan, model: ModelShape) -> list[HostShare]:
    """Each host of the plan and the slice of the model its ranks load."""
    if plan.layout is None or not plan.commands:
        raise StagingError("the plan has no feasible layout to stage for")
    layout, hosts = plan.layout, [command.host for command in plan.commands]
    per_host = plan.hardware.gpus_per_host
    stages = pp_layers(model.layers, layout.pp)
    shares = []
    for index, host in enumerate(hosts):
        if layout.dp > 1:  # whole replicas per host: every stage here
            first, last = 0, layout.pp - 1
        else:  # one replica across hosts: TP inside, PP stages spread
            ranks = range(index * per_host, min((index + 1) * per_host, layout.gpus))
            first, last = ranks[0] // layout.tp, ranks[-1] // layout.tp
        experts = None
        if layout.ep and model.experts is not None and len(hosts) > 1 and layout.dp > 1:
            count = model.experts.routed // len(hosts)
            experts = range(index * count, (index + 1) * count)
        shares.append(HostShare(host=host, layers=range(stages[first].start, stages[last].stop),
                                first_stage=first == 0, last_stage=last == layout.pp - 1, experts=experts))
    return shares


def needed(name: str, share: HostShare, model: ModelShape) -> bool:
    """Whether a host's ranks load tensor `name`."""
    layer = LAYER.search(name)
    if layer:
        number = int(layer.group(1))
        # Multi-token-prediction layers (past num_hidden_layers) go with the last stage.
        if not (share.last_stage if number >= model.layers else number in share.layers):
            return False
        expert = EXPERT.search(name)
        return expert is None or share.experts is None or int(expert.group(1)) in share.experts
    if any(part in name for part in FIRST_STAGE):
        return share.first_stage or (share.last_stage and model.tied_embeddings)
    return share.last_stage if any(part in name for part in LAST_STAGE) else True


# -- writing -------------------------------------------------------------------------------


@dataclass
class Staged:
    host: str
    directory: Path
    files: int
    bytes: int
    resumed: int  # files found complete from an earlier run


def stage_subset(model_dir: Path, plan: Plan, out_dir: Path, *, host: str | None = None, workers: int = 2,
                 on_bytes: Callable[[int], None] = lambda n: None,
                 on_total: Callable[[int], None] = lambda n: None) -> list[Staged]:
    """Stage every host of the plan (or only `host`) into out_dir/<host>/."""
    model = load_model_config(model_dir)
    _check_plan_model(plan, model, model_dir)
    tensors = read_source(model_dir)
    check_against_config(tensors, model)
    shares = _selected(host_shares(plan, model), host, plan)
    jobs = []
    for share in shares:
        directory = out_dir / share.host
        directory.mkdir(parents=True, exist_ok=True)
        by_file: dict[str, list[SourceTensor]] = {}
        for tensor in tensors.values():
            if needed(tensor.name, share, model):
                by_file.setdefault(tensor.file.name, []).append(tensor)
        jobs.append((share, directory,
                     {name: sorted(ts, key=lambda t: t.start) for name, ts in sorted(by_file.items())}))
    on_total(sum(t.size for _, _, files in jobs for ts in files.values() for t in ts))
    return [_stage_host(model_dir, plan, share, directory, files, workers, on_bytes)
            for share, directory, files in jobs]


def stage_sharded(model_dir: Path, plan: Plan, out_dir: Path, *, host: str | None = None,
                  on_bytes: Callable[[int], None] = lambda n: None,
                  on_total: Callable[[int], None] = lambda n: None) -> list[Staged]:
    """vLLM `sharded_state` files (one set per TP rank, fused names, TP-sliced) for each host of
    a plan without pipeline parallelism; every host holds its replica's ranks."""
    model = load_model_config(model_dir)
    _check_plan_model(plan, model, model_dir)
    if plan.layout is None or plan.layout.pp != 1:
        raise StagingError("--format sharded needs a plan without pipeline parallelism (vLLM's sharded_state "
                           "names files by TP rank only)", hint="use --format subset for PP plans")
    shares = _selected(host_shares(plan, model), host, plan)
    tp = plan.layout.tp
    on_total(len(shares) * sum(t.size for t in read_source(model_dir).values()))
    staged = []
    for share in shares:
        directory = out_dir / share.host
        directory.mkdir(parents=True, exist_ok=True)
        manifest = _Manifest.open(directory, model_dir, plan, share, fmt="sharded")
        resumed = 0
        for rank in range(tp):
            key = f"rank-{rank}"
            done = manifest.done(key)
            if isinstance(done, RankFiles) and all((directory / name).is_file() for name in done.files):
                resumed += 1
                continue
            sealed: dict[str, ShardPart] = {}
            paths = write_rank(model_dir, directory, tp_size=tp, rank=rank, progress=on_bytes,
                               seal=_sealer(sealed))
            manifest.record(key, RankFiles(files={p.name: sealed[p.name] for p in paths}))
        copy_side_files(model_dir, directory)
        manifest.finish()
        staged.append(Staged(host=share.host, directory=directory, files=tp, resumed=resumed,
                             bytes=sum(p.stat().st_size for p in directory.glob("model-rank-*.safetensors"))))
    return staged


def _sealer(sealed: dict[str, ShardPart]) -> Callable[[Path, Path], None]:
    """write_rank's seal for staging: each part fsynced while its header and tensor SHA-256 are
    taken, the manifest entry kept in `sealed` under the part's name."""
    def seal(tmp: Path, path: Path) -> None:
        with tmp.open("rb") as handle:
            sealed[path.name] = ShardPart(bytes=tmp.stat().st_size,
                                          **_durable(handle.fileno(), lambda: _part_sha256(tmp)))
    return seal


def _check_plan_model(plan: Plan, model: ModelShape, model_dir: Path) -> None:
    if plan.model.config_sha256 != model.config_sha256:
        raise StagingError(f"the plan was made for {plan.model.name} (config sha256 {plan.model.config_sha256[:12]}), "
                           f"not for {model_dir} ({model.config_sha256[:12]})", hint="plan this model first")


def _selected(shares: list[HostShare], host: str | None, plan: Plan) -> list[HostShare]:
    if host is None:
        return shares
    chosen = [share for share in shares if share.host == host]
    if not chosen:
        raise StagingError(f"--host {host!r} is not in the plan", hint=f"hosts: {[c.host for c in plan.commands]}")
    return chosen


def _stage_host(model_dir: Path, plan: Plan, share: HostShare, directory: Path,
                files: dict[str, list[SourceTensor]], workers: int, on_bytes: Callable[[int], None]) -> Staged:
    manifest = _Manifest.open(directory, model_dir, plan, share)
    resumed = 0
    pending = []
    for name, chosen in files.items():
        if manifest.complete(name, directory / name):
            resumed += 1
            on_bytes(sum(t.size for t in chosen))
        else:
            pending.append((name, chosen))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for name, entry in pool.map(lambda job: (job[0], _write_file(directory / job[0], job[1], on_bytes)), pending):
            manifest.record(name, entry)  # in the caller's thread: one writer of the manifest
    _write_index(directory, files)
    _copy_side_files(model_dir, directory)
    manifest.finish()
    return Staged(host=share.host, directory=directory, files=len(files), resumed=resumed,
                  bytes=sum(t.size for ts in files.values() for t in ts))


def _write_file(target: Path, chosen: list[SourceTensor], on_bytes: Callable[[int], None]) -> SubsetFile:
    """One output safetensors file: a new header, then each tensor's bytes copied as they are."""
    layout, offset = {}, 0
    for tensor in chosen:
        layout[tensor.name] = TensorSource(dtype=tensor.dtype, shape=list(tensor.shape), source=tensor.file.name,
                                           source_offsets=(tensor.start, tensor.end),
                                           offsets=(offset, offset + tensor.size))
        offset += tensor.size
    header = build_header((t.name, t.dtype, list(t.shape), t.size) for t in chosen)
    partial = target.with_name(f".{target.name}.partial")
    with partial.open("wb") as out:
        out.write(header)
        out.flush()
        for source_file, run in _runs(chosen):
            with source_file.open("rb") as src:
                copy_range(src.fileno(), out.fileno(), run[0], run[1] - run[0], on_bytes)
        out.flush()
        digest = _durable(out.fileno(), lambda: _sha256(partial))
    os.replace(partial, target)
    return SubsetFile(sha256=digest, bytes=target.stat().st_size, tensors=layout)


def _runs(chosen: list[SourceTensor]) -> Iterator[tuple[Path, tuple[int, int]]]:
    """Adjacent tensors of one source file merged into one byte range: fewer, larger copies."""
    current: tuple[Path, int, int] | None = None
    for tensor in chosen:
        if current and current[0] == tensor.file and current[2] == tensor.start:
            current = (current[0], current[1], tensor.end)
            continue
        if current:
            yield current[0], (current[1], current[2])
        current = (tensor.file, tensor.start, tensor.end)
    if current:
        yield current[0], (current[1], current[2])


def _durable(fd: int, digest: Callable[[], T]) -> T:
    """fsync a just-written file while hashing it: the disk writes the pages while the CPU hashes
    them from the page cache (one after the other, staging ran at 0.66x the rate)."""
    with ThreadPoolExecutor(max_workers=1) as flusher:
        flushed = flusher.submit(os.fsync, fd)
        result = digest()
        flushed.result()
    return result


def _sha256(path: Path, start: int = 0, end: int | None = None) -> str:
    """SHA-256 of bytes [start, end) of a file (default: all of it), read into one reused buffer.
    (Hashing through mmap spares 15 % of the CPU but puts every page of the file in our RSS.)"""
    end = path.stat().st_size if end is None else end
    digest = hashlib.sha256()
    with path.open("rb", buffering=0) as handle:
        handle.seek(start)
        buffer, position = memoryview(bytearray(HASH_CHUNK)), start
        while position < end:
            count = handle.readinto(buffer[:min(HASH_CHUNK, end - position)])
            if not count:
                raise StagingError(f"{path}: ends at byte {position:,}, {end:,} expected")
            digest.update(buffer[:count])
            position += count
    return digest.hexdigest()


def _write_index(directory: Path, files: dict[str, list[SourceTensor]]) -> None:
    """model.safetensors.index.json naming only this host's files (vLLM refuses missing ones)."""
    weight_map = {t.name: name for name, ts in files.items() for t in ts}
    total = sum(t.size for ts in files.values() for t in ts)
    text = json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
    replace_file(directory / INDEX, text.encode())


def _copy_side_files(model_dir: Path, directory: Path) -> None:
    """config.json, tokenizer and generation files: everything but weights and the old index."""
    for path in model_dir.iterdir():
        if (path.is_file() and path.suffix != ".safetensors" and not path.name.startswith(".")
                and path.name not in (INDEX, MANIFEST, "manifest.json")):
            shutil.copy2(path, directory / path.name)


class _Manifest:
    """The staging manifest of one host directory, saved (atomically) after every finished file."""

    IDENTITY = ("source", "config_sha256", "format", "host", "layers", "experts")

    def __init__(self, directory: Path, manifest: StagingManifest) -> None:
        self.directory = directory
        self.manifest = manifest

    @classmethod
    def open(cls, directory: Path, model_dir: Path, plan: Plan, share: HostShare,
             fmt: Literal["subset", "sharded"] = "subset") -> _Manifest:
        wanted = StagingManifest(source=str(model_dir.resolve()), config_sha256=plan.model.config_sha256,
                                 format=fmt, host=share.host, layers=(share.layers.start, share.layers.stop),
                                 experts=(share.experts.start, share.experts.stop) if share.experts else None)
        if (directory / MANIFEST).exists():
            try:
                found = StagingManifest.load(directory)
            except ApplianceError as exc:  # not discarded silently: it may record hours of work
                raise StagingError(exc.message, hint=f"remove {directory / MANIFEST} to stage this host "
                                   "afresh") from exc
            if all(getattr(found, k) == getattr(wanted, k) for k in cls.IDENTITY):
                return cls(directory, found)  # the same job: resume it
        return cls(directory, wanted)

    def done(self, name: str) -> SubsetFile | RankFiles | None:
        return self.manifest.files.get(name)

    def complete(self, name: str, path: Path) -> bool:
        entry = self.done(name)
        return isinstance(entry, SubsetFile) and path.is_file() and path.stat().st_size == entry.bytes

    def record(self, name: str, entry: SubsetFile | RankFiles) -> None:
        self.manifest.files[name] = entry  # type: ignore[assignment]  # the format decides which
        self.manifest.save(self.directory)

    def finish(self) -> None:
        self.manifest.complete = True
        self.manifest.save(self.directory)


# -- verification --------------------------------------------------------------------------


def verify_staged(directory: Path) -> list[str]:
    """Check every file of a staged directory (or of each host directory under it) against its
    manifest; on a hash mismatch compare with the source to name the tensor. Returns the host
    directories checked; raises StagingError at the first fault."""
    manifests = [directory / MANIFEST] if (directory / MANIFEST).exists() else sorted(directory.glob(f"*/{MANIFEST}"))
    if not manifests:
        raise StagingError(f"{directory}: no {MANIFEST} here or in its host directories")
    for found in manifests:
        try:
            manifest = StagingManifest.load(found.parent)
        except ApplianceError as exc:
            raise StagingError(exc.message) from exc
        if not manifest.complete:
            raise StagingError(f"{found.parent}: staging did not finish (run `appliance stage` again to resume)")
        for name, entry in sorted(manifest.staged_files().items()):
            path = found.parent / name
            if not path.is_file():
                raise StagingError(f"{path}: missing")
            if path.stat().st_size != entry.bytes:
                raise StagingError(f"{path}: {path.stat().st_size:,} bytes, the manifest says {entry.bytes:,}")
            which = (_changed_part(path, entry) if isinstance(entry, ShardPart)
                     else _sha256(path) != entry.sha256 and _which_tensor(path, entry, Path(manifest.source)))
            if which:
                raise StagingError(f"{path}: SHA-256 differs from the manifest; {which}")
    return [str(m.parent) for m in manifests]


def _part_sha256(path: Path) -> _PartDigests:
    """SHA-256 of a sharded part's header and of each tensor's bytes (so a damaged tensor can be
    named; together they cover every byte), the tensors hashed on two threads (hashlib leaves the
    GIL)."""
    header, base = read_header(path)
    spans = {name: entry["data_offsets"] for name, entry in header.items() if name != "__metadata__"}
    with ThreadPoolExecutor(max_workers=2) as pool:
        digests = pool.map(lambda name: _sha256(path, base + spans[name][0], base + spans[name][1]),
                           spans)
        return {"header_sha256": _sha256(path, 0, base), "tensor_sha256": dict(zip(spans, digests, strict=True))}


def _changed_part(path: Path, entry: ShardPart) -> str | None:
    try:
        found = _part_sha256(path)
    except SafetensorsFileError:
        return "the header changed"
    if found["header_sha256"] != entry.header_sha256:
        return "the header changed"
    changed = [name for name, digest in found["tensor_sha256"].items() if entry.tensor_sha256.get(name) != digest]
    return f"tensor {changed[0]} changed" if changed else None


def _which_tensor(path: Path, entry: SubsetFile, source: Path) -> str:
    header, base = read_header(path)
    for name, where in entry.tensors.items():
        start, end = where.offsets
        if header.get(name, {}).get("data_offsets") != [start, end]:
            return f"the header entry of tensor {name} changed"
        with path.open("rb") as staged, (source / where.source).open("rb") as original:
            staged.seek(base + start)
            original.seek(where.source_offsets[0])
            remaining = end - start
            while remaining:
                size = min(remaining, HASH_CHUNK)
                if staged.read(size) != original.read(size):
                    return f"tensor {name} differs from the source {where.source}"
                remaining -= size
    return "the header differs (every tensor's bytes match the source)"
