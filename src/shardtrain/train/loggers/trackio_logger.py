"""trackio (the 'trackio' extra): local-first, a SQLite store under TRACKIO_DIR (default: the Hugging
Face cache), viewed with `trackio show`. One trackio run per launch, named after the run."""

from __future__ import annotations

from typing import Any

from .base import RunInfo, scalars


class TrackioLogger:
    name = "trackio"
    fix = "pip install 'shardtrain[trackio]'"

    def start(self, run: RunInfo) -> None:
        import trackio

        self._trackio = trackio
        # the run measures its own throughput and memory; trackio's samplers would only add threads
        self._run = trackio.init(
            project=run.project,
            name=run.name,
            config={**run.config, "plan": run.plan},
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
        )
        self._step = 0

    def log(self, record: dict[str, Any]) -> None:
        self._step = record["step"]
        self._run.log(scalars(record), step=record["step"])

    def log_table(self, rows: list[dict[str, Any]], *, step: int) -> None:
        table = self._trackio.Table(columns=list(rows[0]), data=[list(row.values()) for row in rows])
        self._run.log({"samples": table}, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        self.log({**summary, "kind": "summary", "step": summary.get("step", self._step)})
        self._run.finish()
