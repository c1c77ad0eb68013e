"""Rank side of the tests of the user errors found before any communication."""

from __future__ import annotations

from shardtrain.engine import Engine
from shardtrain.train.config import load_config
from shardtrain.train.loop import _prepare
from shardtrain.train.startup import StartupClock


def prepare_error(*overrides: str) -> str:
    """The message of the ValueError `_prepare` raises on this rank for `overrides` ('no error' if none)."""
    engine = Engine(accelerator="cpu")
    engine.launch()
    try:
        _prepare(load_config(None, list(overrides)), engine, clock=StartupClock())
    except ValueError as exc:
        return str(exc)
    return "no error"
