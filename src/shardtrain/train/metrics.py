"""What a run records and shows: metrics.jsonl, TensorBoard events, a PNG plot, memory per rank,
and the summary table printed at the end. Only rank 0 writes; every rank measures its own memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .loggers import Trackers


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds of parameters, gradients and optimizer state (its shards, after sharding)."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """This rank's memory figure: peak allocated on CUDA, else the bytes of model state."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return model_state_bytes(model, optimizer)


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class MetricsLog:
    """Appends one JSON object per record to metrics.jsonl and hands it to the run's trackers
    (loggers/): a "summary" record finishes them."""

    def __init__(self, run_dir: Path, *, trackers: Trackers | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        self._file = open(self.path, "a", buffering=1)
        self.trackers = trackers

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        if self.trackers is not None:
            (self.trackers.finish if record["kind"] == "summary" else self.trackers.log)(record)

    def close(self) -> None:
        self._file.close()


def plot_metrics(records: list[dict[str, Any]], path: Path, *, memory_label: str) -> None:
    """Loss (train and held-out), throughput and memory per rank against the step, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, (ax_loss, ax_speed, ax_mem) = plt.subplots(1, 3, figsize=(15, 4))
    # A log interval whose every step was skipped (train.on_nonfinite=skip) has no loss: a gap.
    ax_loss.plot(
        [r["step"] for r in train], [math.nan if r["loss"] is None else r["loss"] for r in train], label="train"
    )
    ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out")
    if any("eval_loss_ema" in r for r in evals):
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss_ema"] for r in evals], "s--", label="held-out (EMA)")
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax_loss.legend()
    ax_speed.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train])
    ax_speed.set(xlabel="step", ylabel="tokens/s (all ranks)", title="throughput")
    if train:
        for rank in range(len(train[0]["memory_bytes"])):
            ax_mem.plot(
                [r["step"] for r in train], [r["memory_bytes"][rank] / 2**20 for r in train], label=f"rank {rank}"
            )
        ax_mem.legend()
    ax_mem.set(xlabel="step", ylabel="MiB", title=memory_label)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@dataclass(frozen=True, kw_only=True)
class Summary:
    """The outcome of a run, as returned by `train.loop.run` and printed as a table."""

    run_dir: str
    model: str
    world: str
    steps: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    first_eval_loss: float | None  # None: nothing held out (data.val_fraction 0), no evaluation
    final_eval_loss: float | None
    memory_per_rank: list[int]
    memory_label: str
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient norm
    data: str | None = None  # the rows' statistics (DataStats.describe, data/pipeline.py), for tokenized data
    stopped: str | None = None  # why the run ended before train.steps (train.early_stop_patience)
    best: str | None = None  # the best checkpoint (run.keep_best) and its score

    @property
    def eval_loss_drop(self) -> float | None:
        """Relative fall of the held-out loss from the first evaluation to the last (None without one)."""
        if self.first_eval_loss is None or self.final_eval_loss is None:
            return None
        return 1.0 - self.final_eval_loss / self.first_eval_loss

    def table(self):
        from rich.table import Table

        table = Table(title="shardtrain train", show_header=False)
        rows = [
            ("model", self.model),
            ("world", self.world),
            (
                "steps",
                f"{self.steps:,}"
                + (
                    f" ({self.skipped_steps:,} skipped: non-finite loss or gradient norm)" if self.skipped_steps else ""
                ),
            ),
            ("tokens", f"{self.tokens:,}"),
            *([("data", self.data)] if self.data else []),
            ("job time", f"{self.wall_s:.1f} s (from launch to the end, on rank 0)"),
            ("throughput", f"{self.tokens_per_s:,.0f} tokens/s"),
            (
                "held-out loss",
                "none: nothing held out (data.val_fraction 0)"
                if self.eval_loss_drop is None
                else f"{self.first_eval_loss:.3f} -> {self.final_eval_loss:.3f} ({self.eval_loss_drop:.1%} lower)",
            ),
            *([("stopped", self.stopped)] if self.stopped else []),
            *([("best checkpoint", self.best)] if self.best else []),
            (self.memory_label, ", ".join(format_bytes(b) for b in self.memory_per_rank)),
            ("run dir", self.run_dir),
        ]
        for key, value in rows:
            table.add_row(key, value)
        return table
