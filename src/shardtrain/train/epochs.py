"""`--train.epochs E`: the run's optimizer steps derived from the training data.

Sample i of the run reads window `perm_e[i mod N]` of epoch e = i div N (N training windows, a
permutation per epoch drawn from the seed: data/batches.py), and optimizer step s reads samples
s·B .. s·B + B - 1 (B = train.batch_size, the global batch): the stream runs on across epoch
boundaries, and a step may take the last windows of one epoch and the first of the next. E epochs are
floor(E·N / B) steps: the run reads the first floor(E·N / B)·B samples, so every window is read E times
except fewer than B of the last epoch's (the partial last batch is dropped once, at the end of the run,
not at each epoch). N and B are the same at every world size and grad_accum (B is the global batch), so
the step count is too, and a resumed run derives the same count.
"""

from __future__ import annotations

import dataclasses
import math

from .sections import Config


def epoch_steps(*, epochs: float, num_windows: int, batch_size: int) -> int:
    """Optimizer steps of `epochs` passes over `num_windows` training windows at a global batch of `batch_size`;
    ValueError with the fix when that is not one step."""
    steps = math.floor(epochs * num_windows / batch_size)
    if steps < 1:
        raise ValueError(
            f"train.epochs={epochs} of {num_windows:,} training windows is fewer than one batch of "
            f"train.batch_size={batch_size}; use at least --train.epochs {batch_size / num_windows:.3g}"
        )
    return steps


def with_epoch_steps(cfg: Config, num_windows: int) -> tuple[Config, str | None]:
    """`cfg` with train.steps derived from train.epochs (when given) and the start-up line that says so."""
    epochs, batch = cfg.train.epochs, cfg.train.batch_size
    if not epochs:
        return cfg, None
    steps = epoch_steps(epochs=epochs, num_windows=num_windows, batch_size=batch)
    line = (
        f"train.epochs {epochs:g} x {num_windows:,} training windows / train.batch_size {batch} = {steps:,} "
        f"optimizer steps ({num_windows // batch:,} per epoch; train.steps is not used)"
    )
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps)), line
