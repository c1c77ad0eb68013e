"""The log window's checkpointed rows: a rank gets its own back at the saved world size, nothing at another
(tests/train/test_dpo_cli.py resumes a whole run on 2 ranks)."""

from types import SimpleNamespace

import pytest
import torch

from shardtrain.train.log_window import LogWindow

SAVED = {"world_size": 2, "ranks": [[1.5, 2.0, 0.25, 3.0], [2.5, 2.0, 0.75, 5.0]]}


def _window() -> LogWindow:
    return LogWindow.empty(device=torch.device("cpu"), metrics=2)


def test_each_rank_gets_its_own_row_back():
    window = _window()
    window.restore(SAVED, engine=SimpleNamespace(world_size=2, rank=1))
    assert (window.loss.item(), window.steps, window.sums.tolist()) == (2.5, 2, [0.75, 5.0])


def test_another_world_size_starts_an_empty_window():
    window = _window()
    window.restore(SAVED, engine=SimpleNamespace(world_size=4, rank=1))
    assert (window.loss.item(), window.steps, window.sums.tolist()) == (0.0, 0, [0.0, 0.0])


def test_another_objectives_window_names_the_fix():
    window = LogWindow.empty(device=torch.device("cpu"), metrics=0)
    with pytest.raises(ValueError, match="holds 2 metric sums, this run's objective 0; resume with the checkpoint's"):
        window.restore(SAVED, engine=SimpleNamespace(world_size=2, rank=0))
