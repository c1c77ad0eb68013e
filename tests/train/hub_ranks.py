"""Rank side of the Hub-id tests: the network off and HF_HOME at the test's cache on this pool rank for
one call (undone after it: the pool's processes live on)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardtrain.engine import Engine
from shardtrain.train.config import load_config
from shardtrain.train.hub_inputs import fetch_hub_inputs
from shardtrain.train.loop import _prepare
from shardtrain.train.startup import StartupClock
from tests.data.hub_fixture import offline_cache
from tests.train.test_cli import _train_here


def train_offline(home: str, args: list[str]) -> tuple[int, str, str]:
    """`shardtrain train ARGS` on this rank, offline, reading the HF cache under `home`."""
    with pytest.MonkeyPatch.context() as patch:
        offline_cache(patch, Path(home))
        return _train_here(args)


def fetch_error(home: str, *overrides: str) -> str:
    """The ValueError this rank raises fetching the Hub ids of `overrides` (offline) or checking the run."""
    with pytest.MonkeyPatch.context() as patch:
        offline_cache(patch, Path(home))
        engine = Engine(accelerator="cpu")
        engine.launch()
        try:
            _prepare(fetch_hub_inputs(load_config(None, list(overrides)), engine=engine), engine, clock=StartupClock())
        except ValueError as exc:
            return str(exc)
        return "no error"
