"""Learning-rate schedule: linear warm-up, then cosine decay to a floor.

The schedule is a function of the optimizer step, never of the micro-batch: with gradient
accumulation the scheduler is stepped once per optimizer step, so changing `grad_accum` (at the same
global batch) leaves the learning-rate curve unchanged.
"""

from __future__ import annotations

import functools
import math

import torch


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    fn = functools.partial(warmup_cosine, warmup_steps=warmup_steps, total_steps=total_steps, min_ratio=min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
