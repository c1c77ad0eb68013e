"""Learning-rate schedules (`--optim.schedule`): built-in warm-up + cosine, or transformers' own.

The default, `cosine` (linear warm-up, then cosine decay to `optim.min_lr_ratio` of the peak), is
built in, so the default build trains without transformers. The others are transformers'
`get_scheduler` with its parameters (the `hf` extra), not rewritten here: `constant` (after a linear
warm-up), `linear` (warm-up, then linear to 0), `cosine_with_restarts` (warm-up, then
`optim.num_cycles` cosine cycles to 0 with hard restarts) and `wsd` (warm-up, stable, then the last
`optim.decay_fraction` of the steps a cosine decay to `optim.min_lr_ratio`).

Every schedule is a `LambdaLR` of the optimizer step, never of the micro-batch: with gradient
accumulation the scheduler is stepped once per optimizer step, so changing `grad_accum` (at the same
global batch) leaves the learning-rate curve unchanged. A checkpoint keeps its `last_epoch` (the step),
and the schedule's parameters come from the configuration, so a resumed run continues the curve.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch

from .sections import OptimConfig

SCHEDULE_NAMES = ("cosine", "constant", "linear", "cosine_with_restarts", "wsd")

# transformers' get_scheduler name of each schedule it provides here
_TRANSFORMERS_NAMES = {
    "constant": "constant_with_warmup",
    "linear": "linear",
    "cosine_with_restarts": "cosine_with_restarts",
    "wsd": "warmup_stable_decay",
}


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


def warmup_steps_of(optim: OptimConfig, total_steps: int) -> int:
    """optim.warmup_ratio of the run's steps (rounded up, as transformers' Trainer does), else optim.warmup_steps."""
    return math.ceil(optim.warmup_ratio * total_steps) if optim.warmup_ratio > 0 else optim.warmup_steps


def transformers_arguments(optim: OptimConfig, total_steps: int) -> dict:
    """`transformers.get_scheduler`'s arguments (less the optimizer) for `optim.schedule`."""
    specific: dict = {}
    if optim.schedule == "cosine_with_restarts":
        specific = {"num_cycles": optim.num_cycles}
    elif optim.schedule == "wsd":
        specific = {
            "num_decay_steps": math.ceil(optim.decay_fraction * total_steps),
            "min_lr_ratio": optim.min_lr_ratio,
        }
    return {
        "name": _TRANSFORMERS_NAMES[optim.schedule],
        "num_warmup_steps": warmup_steps_of(optim, total_steps),
        "num_training_steps": total_steps,
        "scheduler_specific_kwargs": specific,
    }


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, optim: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """`optim.schedule` over `total_steps` optimizer steps."""
    warmup = warmup_steps_of(optim, total_steps)
    if optim.schedule == "cosine":
        return make_scheduler(optimizer, warmup_steps=warmup, total_steps=total_steps, min_ratio=optim.min_lr_ratio)
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(
            f"optim.schedule={optim.schedule!r} is transformers' get_scheduler: pip install 'shardtrain[hf]', "
            "or use --optim.schedule cosine (built in)"
        )
    from transformers import get_scheduler

    return get_scheduler(optimizer=optimizer, **transformers_arguments(optim, total_steps))
