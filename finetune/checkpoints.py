"""Sharded checkpoints of the sharded trainer (finetune.sharded): torch.distributed.checkpoint.

Each checkpoint is a directory `step-N` in every node's own job directory (a node: the ranks of one
host), holding a directory `rank-R` per rank of that node: the rank's own
shards of the adapter and of the optimizer state (DCP's files, saved without collectives) and its
random state. Each rank writes and later reads only its own files, so no host needs another's
disk. The node's first rank writes `manifest.json` last, through an atomic rename: the step, the
tokens trained on, the ranks in all, this node's ranks and the SHA-256 of each of their files.

A checkpoint counts on a node only when its manifest is there and every file it names verifies:
one cut short by a killed rank (no manifest, a missing or changed file) is never resumed from, and
the log says so. The ranks resume from the newest step whole on every node.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
KEEP = 2  # whole checkpoints kept; older ones are deleted once a newer one is whole
STEP_DIR = re.compile(r"step-(\d+)")
RNG = "rng.pt"  # a rank's torch random state, beside its DCP files
RANK_FILE = re.compile(r"rank-\d+/[A-Za-z0-9_.]+")  # what a manifest may name: a file in a rank's directory


@dataclass(frozen=True)
class Resumed:
    step: int
    tokens: int
    rng: Any  # this rank's torch random state, or None


def node(rank: int) -> tuple[int, bool]:
    """The node (host) of job rank `rank` (finetune.sharded.job_rank) and whether it is that node's
    first rank."""
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return rank // per_host, rank % per_host == 0


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def rank_files(directory: Path, rank: int) -> dict[str, str]:
    """The files `rank` wrote into a checkpoint (relative name -> SHA-256)."""
    mine = directory / f"rank-{rank}"
    return {f"{mine.name}/{path.name}": sha256(path) for path in sorted(mine.iterdir()) if path.is_file()}


def write_manifest(directory: Path, step: int, tokens: int, world: int, ranks: list[int],
                   hashes: dict[str, str]) -> None:
    """This node's manifest of the checkpoint, made visible whole or not at all."""
    partial = directory / f".{MANIFEST}.tmp"
    partial.write_text(json.dumps({"step": step, "tokens": tokens, "world_size": world, "ranks": ranks,
                                   "files": hashes}, sort_keys=True))
    partial.replace(directory / MANIFEST)


def problem(directory: Path, world: int) -> str | None:
    """Why this node cannot resume from a checkpoint; None: its part is whole and verifies."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (cut short while it was written)"
    except (OSError, ValueError) as exc:
        return f"its manifest cannot be read: {exc}"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or \
            not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("tokens"), int) or \
            not isinstance(manifest.get("ranks"), list) or not manifest["ranks"] or \
            not all(isinstance(r, int) and not isinstance(r, bool) for r in manifest["ranks"]):
        return "its manifest is not one"
    if manifest.get("world_size") != world:
        return f"written by {manifest.get('world_size')} ranks, this run has {world}"
    if STEP_DIR.fullmatch(directory.name) is None or int(directory.name.split("-")[1]) != manifest["step"]:
        return f"its manifest names step {manifest['step']}"
    files: dict[str, str] = manifest["files"]
    needed = {f"rank-{rank}/{RNG}" for rank in manifest["ranks"]} | {f"rank-{rank}/.metadata" for rank in
                                                                       manifest["ranks"]}
    if missing := sorted(needed - set(files)):
        return f"its manifest names no {', '.join(missing)}"
    for name, digest in sorted(files.items()):
        path = directory / name
        if not RANK_FILE.fullmatch(name) or not path.is_file() or path.is_symlink():
            return f"{name} is missing"
        if sha256(path) != digest:
            return f"{name} does not match its SHA-256"
    return None


def candidates(store: Path) -> list[Path]:
    """Checkpoint directories, newest first."""
    if not store.is_dir():
        return []
    found = [p for p in store.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]), reverse=True)


def whole_steps(store: Path, world: int, log: Callable[[str], None]) -> list[int]:
    """The steps of this node's checkpoints that verify, newest first; each passed over is logged
    with the reason."""
    whole = []
    for directory in candidates(store):
        if (why := problem(directory, world)) is None:
            whole.append(int(directory.name.split("-")[1]))
        else:
            log(f"checkpoint {directory.name} ignored: {why}")
    return whole


def newest_common(per_node: list[list[int]]) -> int | None:
    """The newest step whole on every node; None when there is none."""
    common = set(per_node[0]).intersection(*per_node[1:]) if per_node else set()
    return max(common, default=None)


def prune(store: Path, world: int) -> None:
    """Keep the KEEP newest whole checkpoints; delete the older ones and anything partial below them."""
    whole = 0
    for directory in candidates(store):
        if whole >= KEEP or (whole and problem(directory, world) is not None):
            shutil.rmtree(directory, ignore_errors=True)
        elif problem(directory, world) is None:
            whole += 1


def save(store: Path, step: int, tokens: int, model: Any, optimizer: Any) -> None:
    """Every rank writes its own shards of the adapter and optimizer state and its random state
    into this node's store; each node's first rank then writes the node's manifest."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import save as save_state

    rank, world = dist.get_rank(), dist.get_world_size()
    node_rank, first = node(rank)
    directory = store / f"step-{step}"
    if first:
        shutil.rmtree(directory, ignore_errors=True)  # a partial one from a run that died here
        directory.mkdir(parents=True)
    dist.barrier()
    with alone():
        save_state(local_state(model, optimizer), checkpoint_id=str(directory / f"rank-{rank}"), no_dist=True)
    torch.save(torch.get_rng_state(), directory / f"rank-{rank}" / RNG)
    gathered: list[tuple[int, int, dict[str, str]] | None] = [None] * world
    dist.all_gather_object(gathered, (node_rank, rank, rank_files(directory, rank)))
    if first:
        mine = [found for found in gathered if found is not None and found[0] == node_rank]
        write_manifest(directory, step, tokens, world, sorted(r for _, r, _ in mine),
                       {name: digest for _, _, hashes in mine for name, digest in hashes.items()})
        prune(store, world)
    dist.barrier()


@contextmanager
def alone() -> Iterator[None]:
    """DCP without collectives, as each rank saves and loads its own files: DCP warns that it
    assumes a single process each time, which is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def adapter_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The adapter's (sharded) weights and the optimizer's state. The frozen base is left out by
    name as well: `ignore_frozen_params` still returned a tied output head (torch 2.13)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {k: v for k, v in model_state.items() if ".lora_" in k}, optimizer_state


def local_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """adapter_state with each sharded tensor as this rank's own shard: a view of it, so that a load
    into it lands in the model and the optimizer."""
    model_state, optimizer_state = adapter_state(model, optimizer)
    return {"model": _local(model_state), "optimizer": _local(optimizer_state)}


def _local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {key: _local(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_local(item) for item in value]
    return value


def resume(store: Path, model: Any, optimizer: Any, log: Callable[[str], None]) -> Resumed | None:
    """Load the newest checkpoint whole on every node into the model and optimizer, each rank its
    own files; None when there is none."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as load_state

    rank, world = dist.get_rank(), dist.get_world_size()
    node_rank, first = node(rank)
    gathered: list[tuple[int, list[int]] | None] = [None] * world
    dist.all_gather_object(gathered, (node_rank, whole_steps(store, world, log)) if first else None)
    per_node = {found[0]: found[1] for found in gathered if found is not None}
    step = newest_common(list(per_node.values()))
    if rank == 0:
        for other in sorted({s for steps in per_node.values() for s in steps if step is None or s > step}):
            log(f"checkpoint step-{other} ignored: not whole on node(s) "
                + ", ".join(str(n) for n, steps in sorted(per_node.items()) if other not in steps))
    if step is None:
        return None
    directory = store / f"step-{step}"
    if rank == 0:
        log(f"resuming from checkpoint {directory.name} (step {step})")
    tokens = json.loads((directory / MANIFEST).read_text())["tokens"]
    model_state, optimizer_state = adapter_state(model, optimizer)
    with alone():
        load_state({"model": _local(model_state), "optimizer": _local(optimizer_state)},
                   checkpoint_id=str(directory / f"rank-{rank}"), no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    rng = torch.load(directory / f"rank-{rank}" / RNG, weights_only=True)
    return Resumed(step=step, tokens=int(tokens), rng=rng)
