"""Rank-side helper of test_tracking_cli: `shardtrain train` on a pool rank with the trackers' environment
(WANDB_MODE=offline and the like) set for the run and put back after."""

import os

from tests.train.test_cli import _train_here


def train_with_env(env: dict[str, str], args: list[str]) -> tuple[int, str, str]:
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        return _train_here(args)
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
