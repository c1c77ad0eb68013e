"""train.early_stop_patience: stop when the held-out metric has not improved for N evaluations.

An evaluation improves when its value is below the best so far by more than train.early_stop_min_delta.
The held-out loss is all-reduced, so every rank sees the same values and stops at the same step. The
count and the best so far travel in the run's checkpoints (`state_dict`), so a resumed run stops at the
step the uninterrupted one would have.
"""

from __future__ import annotations

import math


class EarlyStop:
    def __init__(self, *, patience: int, min_delta: float, metric: str) -> None:
        self.patience = patience
        self.min_delta = min_delta
        self.metric = metric
        self.best = math.inf
        self.best_step: int | None = None
        self.stale = 0  # evaluations since the last improvement

    def state_dict(self) -> dict[str, float | int]:
        return {"best": self.best, "best_step": -1 if self.best_step is None else self.best_step, "stale": self.stale}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.best, self.stale = float(state["best"]), int(state["stale"])
        self.best_step = None if int(state["best_step"]) < 0 else int(state["best_step"])

    def update(self, step: int, value: float) -> str | None:
        """Take the evaluation at `step`; the reason to stop now, or None to go on."""
        if value < self.best - self.min_delta:
            self.best, self.best_step, self.stale = value, step, 0
            return None
        self.stale += 1
        if not self.patience or self.stale < self.patience:
            return None
        return (
            f"early stop at step {step}: {self.metric} did not improve by more than {self.min_delta:g} in "
            f"{self.patience} evaluations (best {self.best:.4f} at step {self.best_step})"
        )
