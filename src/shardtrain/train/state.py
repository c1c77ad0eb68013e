"""Where the data stream stands, as stored in a checkpoint of the main job.

Batches are a pure function of (seed, sample index), so the optimizer step and the samples consumed
put the data stream back exactly where it stopped. (Every rank's random-number generators are saved
and restored by `shardtrain.checkpoint` itself.)
"""

from __future__ import annotations


def data_position(*, step: int, batch_size: int) -> dict[str, int]:
    return {"step": step, "samples_seen": step * batch_size}


def check_data_position(position: dict[str, int], *, batch_size: int) -> int:
    """The step to resume at; the batch size must be the one the checkpoint was written with."""
    step, seen = int(position["step"]), int(position["samples_seen"])
    if seen != step * batch_size:
        raise ValueError(
            f"the checkpoint was written with train.batch_size={seen // max(step, 1)}, this run has "
            f"{batch_size}; resume with --train.batch_size {seen // max(step, 1)}"
        )
    return step
