"""What a checkpoint of the main job holds besides model, optimizer and scheduler.

- The data position: the optimizer step and the samples consumed. Batches are a pure function of
  (seed, sample index), so this alone puts the data stream back exactly where it stopped.
- Every rank's random-number generators (Python, NumPy, torch CPU and CUDA), gathered to plain lists
  of ints so that any checkpoint format can store them as metadata; on resume each rank takes its own.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def rng_state() -> dict[str, Any]:
    """This rank's generator states as JSON-compatible values."""
    np_state = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def gather_rng_states(world_size: int) -> list[dict[str, Any]]:
    """Every rank's generator states, in rank order, on every rank (a collective: all ranks call it)."""
    out: list[Any] = [None] * world_size
    if world_size == 1:
        out[0] = rng_state()
    else:
        dist.all_gather_object(out, rng_state())
    return out


def restore_rng_states(states: list[dict[str, Any]], *, rank: int, world_size: int) -> None:
    if len(states) != world_size:
        raise ValueError(f"the checkpoint holds random states of {len(states)} ranks, this run has {world_size}; "
                         "resume at the same world size (or start a new run from the weights)")
    set_rng_state(states[rank])


def data_position(*, step: int, batch_size: int) -> dict[str, int]:
    return {"step": step, "samples_seen": step * batch_size}


def check_data_position(position: dict[str, int], *, batch_size: int) -> int:
    """The step to resume at; the batch size must be the one the checkpoint was written with."""
    step, seen = int(position["step"]), int(position["samples_seen"])
    if seen != step * batch_size:
        raise ValueError(f"the checkpoint was written with train.batch_size={seen // max(step, 1)}, this run has "
                         f"{batch_size}; resume with --train.batch_size {seen // max(step, 1)}")
    return step
