"""Rank side of the held-out tests: one evaluation of the main job, and a whole run without held-out data."""

from __future__ import annotations

import contextlib
import io
import time

from rich.console import Console

from shardtrain.train.loop import _loop, _run_dir
from tests.train.jobs import pretrained_job

UNPACKED = ("--data.packing", "false")  # one window per row


def held_out_loss(folder: str, data: str, held: str, cache: str, *extra: str) -> dict:
    """The job's held-out loss before training, and the held-out micro-batches this rank read."""
    job = pretrained_job(folder, data, cache, *UNPACKED, "--data.eval_path", held, *extra)
    read = []
    batch = job.data.held_out.batch

    def recording(index):
        read.append(index)
        return batch(index)

    job.data.held_out.batch = recording
    return {"loss": job.held_out_loss()[0], "read": read}


def train_without_held_out(folder: str, data: str, cache: str, out_dir: str) -> dict:
    """A short run with data.val_fraction 0: what it printed, its training windows and its records."""
    extra = ["--data.val_fraction", "0", "--train.batch_size", "4", "--train.steps", "2", "--train.eval_every", "1"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        job = pretrained_job(folder, data, cache, *UNPACKED, *extra, "--run.out_dir", out_dir, "--run.name", "whole")
        run_dir = _run_dir(job.cfg, job.engine)
        summary = _loop(job, run_dir, first_step=0, description="", start=time.perf_counter())
    table = io.StringIO()
    Console(file=table, width=200).print(summary.table())
    return {
        "stdout": out.getvalue(),
        "held_out": job.data.held_out,
        "train_rows": len(job.data.train.windows),
        "stats_rows": job.data.stats.rows,
        "eval_loss": summary.final_eval_loss,
        "table": table.getvalue(),
    }
