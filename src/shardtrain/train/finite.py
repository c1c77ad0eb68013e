"""What the training loop does with a non-finite loss or gradient norm (`train.on_nonfinite`).

- "stop": each step records, on the device and without a host sync, the first step whose loss or
  gradient norm is not finite. The loop calls `check` at every host sync it already makes (a log
  line, an evaluation, a checkpoint, the end) and always before a checkpoint is written: every rank
  learns the same first bad step, and the run stops there with an error naming it, so `latest`
  never points at weights trained on NaN.
- "skip": the verdict is agreed by all ranks before `optimizer.step()` (one scalar all-reduce and a
  host sync per step), and a bad step is skipped on every rank and counted.

Under fp16 the gradient norm is left to the loss scaler, whose job is to skip overflowing steps;
the loss must still be finite.
"""

from __future__ import annotations

import math
import sys

import torch

_NONE = math.inf  # "no bad step yet"


class NonFiniteError(ValueError):
    """Training met a non-finite loss or gradient norm under train.on_nonfinite=stop."""


class NonFiniteGuard:
    """Per-run state of the non-finite check; `engine` is the launched Engine (for the agreement)."""

    def __init__(self, engine, *, mode: str, check_norm: bool) -> None:
        self.engine = engine
        self.mode = mode
        self.check_norm = check_norm
        self.skipped = 0
        # (step, loss, gradient norm) of this rank's first bad step; step = inf while there is none.
        self._first = torch.tensor([_NONE, 0.0, 0.0], dtype=torch.float64, device=engine.device)

    def _values(self, step: int, loss: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """(step, loss, norm) on the device; built with fills, not copies from the host, so no sync."""
        device = loss.device
        norm = (
            norm.detach().double().to(device)
            if self.check_norm
            else torch.zeros((), dtype=torch.float64, device=device)
        )
        return torch.stack(
            [torch.full((), float(step), dtype=torch.float64, device=device), loss.detach().double(), norm]
        )

    def skips(self, step: int, loss: torch.Tensor, norm: torch.Tensor | None) -> bool:
        """After the backward of optimizer step `step` (1-based): whether to skip its `optimizer.step()`.

        Only "skip" ever answers True (and syncs); "stop" records a bad step for `check`."""
        values = self._values(step, loss, norm)
        if self.mode == "stop":
            first_seen = ~torch.isfinite(values[1:]).all() & (self._first[0] == _NONE)
            self._first = torch.where(first_seen, values, self._first)
            return False
        every = self.engine.all_gather(values).tolist()
        if all(math.isfinite(v) for first in every for v in first[1:]):
            return False
        self.skipped += 1
        if self.engine.rank == 0:
            print(
                f"shardtrain train: step {step}: {_what(every)}; skipped this optimizer step on every rank "
                f"({self.skipped} skipped so far)",
                file=sys.stderr,
                flush=True,
            )
        return True

    def check(self) -> None:
        """Under "stop", at a host sync on every rank: raise `NonFiniteError` if any rank saw a bad step."""
        if self.mode != "stop":
            return
        every = self.engine.all_gather(self._first).tolist()
        step = min(first[0] for first in every)
        if step == _NONE:
            return
        raise NonFiniteError(
            f"step {int(step)}: {_what([f for f in every if f[0] == step])}; stopped before writing "
            "any checkpoint of it (the last checkpoint, if any, is from a finite step). Lower "
            "--optim.lr, check the data, or pass --train.on_nonfinite skip to skip such steps"
        )


def _what(every: list[list[float]]) -> str:
    """What was not finite, from each rank's [step, loss, norm] of one step."""
    parts = [
        f"the training loss is {loss:g} on rank {rank}"
        for rank, (_, loss, _) in enumerate(every)
        if not math.isfinite(loss)
    ]
    norm = every[0][2]  # the global norm: the same on every rank
    if not math.isfinite(norm):
        parts.append(f"the gradient norm is {norm:g}")
    return " and ".join(parts)
