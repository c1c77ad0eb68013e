"""TensorBoard event files in runs/<name>/tensorboard (the 'tensorboard' extra)."""

from __future__ import annotations

from typing import Any

from .base import RunInfo, scalars


class TensorBoardLogger:
    name = "tensorboard"
    fix = "pip install 'shardtrain[tensorboard]'"

    def start(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run.run_dir / "tensorboard"))
        self._writer.add_text("plan", run.plan)

    def log(self, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self._writer.add_scalar(key, value, record["step"])

    def log_table(self, rows: list[dict[str, Any]], *, step: int) -> None:
        text = "\n\n".join(f"**{row['prompt']}** {row['completion']} (reference: {row['reference']})" for row in rows)
        self._writer.add_text("samples", text, step)

    def finish(self, summary: dict[str, Any]) -> None:
        self._writer.close()
