"""Where a run's start goes: the seconds from the process's start to the end of its first training step,
by phase, written once to metrics.jsonl as the `startup` record (rank 0's clock).

A slow first step has many possible causes (imports, tokenizing a corpus, loading weights, compiling
kernels); the record tells them apart without a profiler:

    launch_s       the process's start to the training loop: interpreter, imports, process group
    fetch_s        downloading a model or data named by Hub id (or finding it in the HF cache)
    model_s        building the model (on the meta device when sharded)
    data_s         reading, tokenizing and packing the data, or opening its streams
    shard_s        sharding the model and building the optimizer
    weights_s      loading pretrained weights into the shards
    probes_s       the packing and chunked-loss probes (forwards, so kernel compiles count here)
    resume_s       loading the checkpoint of a resumed run
    first_eval_s   the evaluation and samples before the first step
    first_step_s   the first step itself (its compiles included)
    total_s        their sum: launch to the end of the first step
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__ = ["StartupClock", "process_age_s"]


def process_age_s() -> float | None:
    """Seconds since this process started, from /proc (Linux); None where /proc cannot tell."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        started_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime; fields after `comm` start at 3
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Made when the training loop starts; `mark(phase)` ends a phase (the module docstring's names,
    without `_s`), `record(step)` gives the `startup` record. A phase marked twice adds up."""

    def __init__(self) -> None:
        self._launch = process_age_s()
        self._last = time.perf_counter()
        self._phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._phases[phase] = self._phases.get(phase, 0.0) + now - self._last
        self._last = now

    def record(self, *, step: int) -> dict[str, Any]:
        phases = {"launch": self._launch, **self._phases}
        seconds = {f"{name}_s": round(value, 3) for name, value in phases.items() if value is not None}
        return {"kind": "startup", "step": step, **seconds, "total_s": round(sum(seconds.values()), 3)}
