"""Sharded checkpoints of the sharded trainer (finetune.sharded): torch.distributed.checkpoint.

Each checkpoint is a directory `step-N` holding every rank's shard of the adapter and of the
optimizer state (DCP's files), each rank's random state (`rng-R.pt`) and, written last by the
first rank through an atomic rename, `manifest.json`: the step, the tokens trained on, the
number of ranks and the SHA-256 of every rank's files. A checkpoint counts only when its
manifest is there and every file it names verifies: one cut short by a killed rank (no
manifest, a missing or changed file) is never resumed from, and the log says so. Each rank
hashes only the files it wrote, so the manifest does not assume the ranks share one host.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
KEEP = 2  # whole checkpoints kept; older ones are deleted once a newer one is whole
STEP_DIR = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class Resumed:
    step: int
    tokens: int
    rng: Any  # this rank's torch random state, or None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def rank_files(directory: Path, rank: int) -> list[Path]:
    """The files `rank` wrote into a checkpoint: its DCP shard files and random state, and for the
    first rank DCP's metadata too."""
    found = [*directory.glob(f"__{rank}_*.distcp"), directory / f"rng-{rank}.pt"]
    if rank == 0:
        found.append(directory / ".metadata")
    return sorted(p for p in found if p.is_file())


def write_manifest(directory: Path, step: int, tokens: int, world: int, hashes: dict[str, str]) -> None:
    """The checkpoint's manifest, made visible whole or not at all."""
    partial = directory / f".{MANIFEST}.tmp"
    partial.write_text(json.dumps({"step": step, "tokens": tokens, "world_size": world, "files": hashes},
                                  sort_keys=True))
    partial.replace(directory / MANIFEST)


def problem(directory: Path, world: int) -> str | None:
    """Why a checkpoint cannot be resumed from; None: it is whole and verifies."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (cut short while it was written)"
    except (OSError, ValueError) as exc:
        return f"its manifest cannot be read: {exc}"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or \
            not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("tokens"), int):
        return "its manifest is not one"
    if manifest.get("world_size") != world:
        return f"written by {manifest.get('world_size')} ranks, this run has {world}"
    if STEP_DIR.fullmatch(directory.name) is None or int(directory.name.split("-")[1]) != manifest["step"]:
        return f"its manifest names step {manifest['step']}"
    files: dict[str, str] = manifest["files"]
    needed = {".metadata", *(f"rng-{rank}.pt" for rank in range(world))}
    if missing := sorted(needed - set(files)):
        return f"its manifest names no {', '.join(missing)}"
    for name, digest in sorted(files.items()):
        path = directory / name
        if "/" in name or name in ("", ".", "..") or not path.is_file():
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


def newest_whole(store: Path, world: int, log: Callable[[str], None]) -> Path | None:
    """The newest checkpoint that verifies; each newer one passed over is logged with the reason."""
    for directory in candidates(store):
        if (why := problem(directory, world)) is None:
            return directory
        log(f"checkpoint {directory.name} ignored: {why}")
    return None


def prune(store: Path, world: int) -> None:
    """Keep the KEEP newest whole checkpoints; delete the older ones and anything partial below them."""
    whole = 0
    for directory in candidates(store):
        if whole >= KEEP or (whole and problem(directory, world) is not None):
            shutil.rmtree(directory, ignore_errors=True)
        elif problem(directory, world) is None:
            whole += 1


def save(store: Path, step: int, tokens: int, model: Any, optimizer: Any) -> None:
    """Every rank writes its shards of the adapter and optimizer state and its random state; the
    first rank then writes the manifest from every rank's file hashes."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import save as save_state

    rank, world = dist.get_rank(), dist.get_world_size()
    directory = store / f"step-{step}"
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)  # a partial one from a run that died here
        directory.mkdir(parents=True)
    dist.barrier()
    model_state, optimizer_state = adapter_state(model, optimizer)
    save_state({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory))
    torch.save(torch.get_rng_state(), directory / f"rng-{rank}.pt")
    hashes = {path.name: sha256(path) for path in rank_files(directory, rank)}
    gathered: list[dict[str, str] | None] = [None] * world
    dist.all_gather_object(gathered, hashes)
    if rank == 0:
        write_manifest(directory, step, tokens, world, {k: v for found in gathered for k, v in (found or {}).items()})
        prune(store, world)
    dist.barrier()


def adapter_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The adapter's (sharded) weights and the optimizer's state. The frozen base is left out by
    name as well: `ignore_frozen_params` still returned a tied output head (torch 2.13)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {k: v for k, v in model_state.items() if ".lora_" in k}, optimizer_state


def resume(store: Path, model: Any, optimizer: Any, log: Callable[[str], None]) -> Resumed | None:
    """Load the newest whole checkpoint into the model and optimizer (the first rank chooses, every
    rank loads the same one); None when there is none."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as load_state

    rank, world = dist.get_rank(), dist.get_world_size()
    chosen: list[Any] = [None]
    if rank == 0:
        found = newest_whole(store, world, log)
        if found is not None:
            manifest = json.loads((found / MANIFEST).read_text())
            chosen = [(str(found), manifest["step"], manifest["tokens"])]
            log(f"resuming from checkpoint {found.name} (step {manifest['step']})")
    dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        return None
    path, step, tokens = chosen[0]
    model_state, optimizer_state = adapter_state(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    load_state(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    rng = torch.load(Path(path) / f"rng-{rank}.pt", weights_only=True)
    return Resumed(step=int(step), tokens=int(tokens), rng=rng)
