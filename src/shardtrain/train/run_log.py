"""The run's record on rank 0: metrics.jsonl (metrics.py) and the trackers of run.loggers (loggers/)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .config import to_dict
from .loggers import Logger, RunInfo, start_trackers
from .metrics import MetricsLog
from .sections import Config


def mlflow_uri(cfg: Config) -> str:
    """run.mlflow_uri, else MLFLOW_TRACKING_URI, else a file store beside the runs."""
    return (
        cfg.run.mlflow_uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or (Path(cfg.run.out_dir) / "mlruns").resolve().as_uri()
    )


def open_run_log(cfg: Config, run_dir: Path, *, plan: str, extra: Sequence[Logger]) -> MetricsLog:
    """metrics.jsonl, appended, and the trackers that start (run.loggers, run.tensorboard, `extra`); they get
    `plan` (the run's model and world) with `shardtrain plan`'s report of the config."""
    names = list(dict.fromkeys([*cfg.run.loggers, *(["tensorboard"] if cfg.run.tensorboard else [])]))
    if not names and not extra:
        return MetricsLog(run_dir)
    from .plan_report import plan_report  # here: planned_config imports the loop that imports this module

    try:  # what `shardtrain plan` prints for this config: units, precision audit, memory estimate
        plan = f"{plan}\n\n{plan_report(cfg)}"
    except ValueError as exc:
        plan = f"{plan}\n\n(shardtrain plan: {exc})"
    run = RunInfo(
        name=run_dir.name,
        run_dir=run_dir,
        project=cfg.run.project,
        config=to_dict(cfg),
        plan=plan,
        mlflow_uri=mlflow_uri(cfg),
    )
    return MetricsLog(run_dir, trackers=start_trackers(names, run, extra=extra))
