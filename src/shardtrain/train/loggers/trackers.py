"""The run's trackers, fed together on rank 0; a tracker that fails never stops the run.

A tracker that cannot start (its library missing, no login, no server) is one line naming it and the
fix, and the run goes on without it; one that fails later (a network gone at step 500) is dropped
the same way. metrics.jsonl (metrics.py) stays the run's own record whatever the trackers do.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from .base import Logger, RunInfo
from .mlflow_logger import MlflowLogger
from .tensorboard_logger import TensorBoardLogger
from .trackio_logger import TrackioLogger
from .wandb_logger import WandbLogger

_BUILT_IN: dict[str, Callable[[], Logger]] = {
    "tensorboard": TensorBoardLogger,
    "wandb": WandbLogger,
    "mlflow": MlflowLogger,
    "trackio": TrackioLogger,
}
LOGGER_NAMES = tuple(_BUILT_IN)


def _note(line: str) -> None:
    print(f"note: {line}", file=sys.stderr, flush=True)


def _reason(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


class Trackers:
    """The started trackers; each call goes to every one still running."""

    def __init__(self, loggers: list[Logger]) -> None:
        self.loggers = loggers

    def _each(self, call: Callable[[Logger], Any], what: str) -> None:
        for logger in list(self.loggers):
            try:
                call(logger)
            except Exception as exc:
                self.loggers.remove(logger)
                _note(f"logger {logger.name} failed to {what} ({_reason(exc)}); the run continues without it")

    def log(self, record: dict[str, Any]) -> None:
        self._each(lambda logger: logger.log(record), "log")

    def log_table(self, rows: list[dict[str, Any]], *, step: int) -> None:
        if rows:
            self._each(lambda logger: logger.log_table(rows, step=step), "log the samples")

    def finish(self, summary: dict[str, Any]) -> None:
        self._each(lambda logger: logger.finish(summary), "finish")
        self.loggers = []


def start_trackers(names: Sequence[str], run: RunInfo, *, extra: Sequence[Logger] = ()) -> Trackers:
    """Start the built-in trackers `names` (LOGGER_NAMES) and the `extra` logger objects; those that
    cannot start are left out, each with one line saying why and how to fix it."""
    started = []
    for logger in [*(_BUILT_IN[name]() for name in names), *extra]:
        try:
            logger.start(run)
        except Exception as exc:
            fix = getattr(logger, "fix", "see its error")
            _note(f"logger {logger.name} did not start ({_reason(exc)}); fix: {fix}. The run continues without it")
            continue
        started.append(logger)
    return Trackers(started)
