"""Per-rank torch files: the state dicts of plain objects, and the random-number generators.

Every rank writes its own file, because some objects hold rank-local state (an EMA of this rank's
shards, per-rank generators). Loading at the same world size, each rank reads its own file; at
another world size every rank reads rank 0's (schedulers, GradScaler and other replicated state
carry over; generator states are left alone, as no rank of the new world corresponds to an old one).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .format import rank_file
from .rng import capture_rng, restore_rng
from .tensorfile import CheckpointFiles, FileRecord, writing
from .values import check_weights_only


def rank_payload(objects: dict[str, Any]) -> dict[str, Any]:
    """What this rank's file will hold; raises if a state dict would not load with weights_only."""
    states = {}
    for key, obj in objects.items():
        state = obj.state_dict()
        check_weights_only(state, f"state[{key!r}].state_dict()")
        states[key] = state
    return {"objects": states, "rng": capture_rng()}


def write_rank_file(directory: Path, rank: int, payload: dict[str, Any]) -> dict[str, FileRecord]:
    name = rank_file(rank)
    path = directory / name
    with writing(path), open(path, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    return {name: FileRecord.of(path)}


def restore_objects(files: CheckpointFiles, objects: dict[str, Any], *, rank: int, same_world: bool) -> None:
    """Load the saved state dicts into `objects` (keys known to be saved), and the generators."""
    if not objects and not same_world:
        return
    payload = files.torch_file(rank_file(rank if same_world else 0))
    for key, obj in objects.items():
        obj.load_state_dict(payload["objects"][key])
    if same_world:
        restore_rng(payload["rng"])
