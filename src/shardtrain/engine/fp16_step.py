"""fp16 under the engine: the user's `optimizer.step()` goes through the loss scaler.

Under `precision="16-mixed"` the engine scales the loss in `backward` and unscales before clipping;
the optimizer's own `step()` then skips a step whose gradients overflowed and updates the scale, as
Fabric does, so the user's loop stays `backward`, `step`, `zero_grad`.
"""

from __future__ import annotations

import types
from typing import Any

import torch


def step_through_scaler(optimizer: torch.optim.Optimizer, scaler) -> None:
    """Make `optimizer.step()` skip overflowing steps and update the scale, as Fabric does for fp16.

    The replacement is a bound method, as an LR scheduler built afterwards expects (it wraps
    `optimizer.step.__func__`). The scaler calls `optimizer.step()` itself once it finds no inf/NaN:
    that nested call (through whatever wraps the method by then) goes to the original step.
    """
    inner = optimizer.step
    inside = False

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        nonlocal inside
        if inside:
            return inner(*args, **kwargs)
        inside = True
        try:
            result = scaler.step(self, *args, **kwargs)
            scaler.update()
        finally:
            inside = False
        return result

    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
