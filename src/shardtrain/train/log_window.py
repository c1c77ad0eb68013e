"""What a rank has trained since the loop's last log record, kept through checkpoints.

A log record (every train.log_every steps) reports the mean loss of the steps since the previous one and,
for train.objective dpo, the means of TRL's metrics over their pairs. A checkpoint written between two
records (run.checkpoint_every not a multiple of train.log_every) holds every rank's window, so the first
record of a resumed run covers the same steps, with the same values, as the uninterrupted run's. The window
is saved as plain values, every rank's row: a resume at the same world size gives each rank its own row back
exactly; at another world size no rank corresponds to an old one, and the first record covers only the steps
run since the resume.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import Engine


@dataclass(kw_only=True)
class LogWindow:
    """This rank's summed step losses (skipped steps left out), their count, and the objective's own sums."""

    loss: torch.Tensor  # 0-dim, on the device, the dtype of the step's loss
    steps: int
    sums: torch.Tensor  # [metrics] on the host (DPO: dpo_loss.metric_sums); empty for the LM loss

    @classmethod
    def empty(cls, *, device: torch.device, metrics: int) -> LogWindow:
        return cls(loss=torch.zeros((), device=device), steps=0, sums=torch.zeros(metrics))

    def add_step(self, loss: torch.Tensor) -> None:
        self.loss += loss
        self.steps += 1

    def take_loss(self, engine: Engine) -> float | None:
        """The mean step loss over every rank since the last record (None: every step skipped); empties it.
        Skipped steps are agreed by every rank, so `steps` is the same on all of them."""
        mean = engine.all_reduce(self.loss / self.steps).item() if self.steps else None
        self.loss.zero_()
        self.steps = 0
        return mean

    def take_sums(self, engine: Engine) -> torch.Tensor:
        """The objective's sums added over every rank since the last record (on the host); empties them."""
        total = engine.all_reduce(self.sums, op="sum").cpu()
        self.sums.zero_()
        return total

    def gathered(self, engine: Engine) -> dict:
        """Every rank's window as plain values for the checkpoint (a collective: every rank calls it)."""
        row = torch.tensor([self.loss.item(), float(self.steps), *self.sums.tolist()], dtype=torch.float64)
        return {"world_size": engine.world_size, "ranks": engine.all_gather(row).cpu().tolist()}

    def restore(self, saved: dict, *, engine: Engine) -> None:
        """This rank's row of `saved` (from `gathered`), at the world size it was saved at."""
        if int(saved["world_size"]) != engine.world_size:
            return
        loss, steps, *sums = saved["ranks"][engine.rank]
        if len(sums) != self.sums.numel():
            raise ValueError(
                f"the checkpoint's log window holds {len(sums)} metric sums, this run's objective {self.sums.numel()}; "
                "resume with the checkpoint's train.objective"
            )
        self.loss.fill_(loss)
        self.steps = int(steps)
        self.sums.copy_(torch.tensor(sums, dtype=torch.float64))
