"""Weights & Biases (the 'wandb' extra): one W&B run per launch, named after the run, under run.project.

Offline (WANDB_MODE=offline) it writes runs/<name>/wandb/offline-run-*, which `wandb sync` uploads.
"""

from __future__ import annotations

from typing import Any

from .base import RunInfo, scalars


class WandbLogger:
    name = "wandb"
    fix = "pip install 'shardtrain[wandb]' and `wandb login` (or set WANDB_MODE=offline)"

    def start(self, run: RunInfo) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(
            project=run.project,
            name=run.name,
            dir=str(run.run_dir),
            config={**run.config, "plan": run.plan},
            settings=wandb.Settings(console="off"),
        )

    def log(self, record: dict[str, Any]) -> None:
        self._run.log(scalars(record), step=record["step"])

    def log_table(self, rows: list[dict[str, Any]], *, step: int) -> None:
        table = self._wandb.Table(columns=list(rows[0]), data=[list(row.values()) for row in rows])
        self._run.log({"samples": table}, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        self._run.summary.update({k: v for k, v in summary.items() if k != "kind"})
        self._run.finish()
