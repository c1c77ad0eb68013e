"""Rank side: the main job of a pretrained folder and rows, built on this rank of a pool."""

from __future__ import annotations

from shardtrain.engine import Engine
from shardtrain.train.config import load_config
from shardtrain.train.loop import build_job
from shardtrain.train.step import Job


def pretrained_job(folder: str, data: str, cache: str, *extra: str) -> Job:
    """`build_job` for `--model.pretrained folder --data.path data` (seq_len 48, no progress bars) and `extra`."""
    engine = Engine(accelerator="cpu")
    engine.launch()
    overrides = ["--model.pretrained", folder, "--data.path", data, "--data.seq_len", "48", "--data.cache_dir", cache]
    return build_job(load_config(None, [*overrides, "--run.progress", "false", *extra]), engine)[0]
