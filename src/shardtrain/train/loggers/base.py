"""The logger interface: what a run hands every experiment tracker, and the scalars of one record.

A logger is anything with `start(run)`, `log(record)`, `log_table(rows, step=)` and `finish(summary)`:
the built-in ones (TensorBoard, Weights & Biases, MLflow, trackio) and any object passed to
`shardtrain.train.loop.run(..., loggers=[...])`. Records are the ones metrics.jsonl holds (`kind`
"train" or "eval", `step`, numbers, and per-rank lists such as `memory_bytes`); only rank 0 logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """What a tracker records about the run once, at its start."""

    name: str  # the run's name (its folder under run.out_dir); the tracker's run name
    run_dir: Path
    project: str  # W&B project, MLflow experiment, trackio project
    config: dict[str, Any]  # the resolved configuration, {section: {key: value}} as config.yaml holds it
    plan: str  # the model, the world and the data, as the summary table describes them
    mlflow_uri: str  # MLflow's tracking URI


class Logger(Protocol):
    """One experiment tracker. A method that raises drops this logger for the rest of the run (one line
    says so); the run itself goes on."""

    name: str
    fix: str  # what to do when it cannot start: the package to install, the login to make

    def start(self, run: RunInfo) -> None: ...

    def log(self, record: dict[str, Any]) -> None: ...

    def log_table(self, rows: list[dict[str, Any]], *, step: int) -> None: ...

    def finish(self, summary: dict[str, Any]) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """`record`'s numbers under '<kind>/<key>' (a per-rank list as '<kind>/<key>/rank<i>', a dict of named
    numbers, e.g. each source's held-out loss, as '<kind>/<key>/<name>'); None is skipped."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("step", "kind") or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[f"{record['kind']}/{key}"] = float(value)
        elif isinstance(value, list):
            out.update({f"{record['kind']}/{key}/rank{rank}": float(v) for rank, v in enumerate(value)})
        elif isinstance(value, dict):
            out.update({f"{record['kind']}/{key}/{name}": float(v) for name, v in value.items()})
    return out


def flat_config(config: dict[str, Any]) -> dict[str, str]:
    """{'train.steps': '120', ...}: the configuration as the flat string parameters MLflow keeps."""
    return {f"{section}.{key}": str(value) for section, table in config.items() for key, value in table.items()}
