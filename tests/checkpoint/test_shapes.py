"""Every parameter shape the engine shards saves and loads bit for bit, in both formats, with and
without optimizer state: one-element and 0-dim parameters, fewer rows than ranks, uneven rows, tied,
frozen and bf16 parameters (tests/checkpoint/shapes.py)."""

import pytest

from tests.checkpoint.shapes import round_trip

NAMES = [
    "blocks.0.lin.bias",
    "blocks.0.lin.weight",
    "blocks.0.uneven",
    "blocks.1.lin.bias",
    "blocks.1.lin.weight",
    "blocks.1.uneven",
    "embed.weight",
    "frozen",
    "frozen_bf16",
    "head.bias",
    "head.weight",
    "logit_scale",
    "seen",
    "unembed.weight",
]


@pytest.mark.parametrize("with_optimizer", [False, True], ids=["model", "model+optimizer"])
@pytest.mark.parametrize("fmt", ["sharded", "full"])
@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_shape_round_trips_exactly(pools, tmp_path, world, fmt, with_optimizer):
    for names in pools(world).run(round_trip, str(tmp_path / "ckpt"), fmt, with_optimizer):
        assert names == NAMES


@pytest.mark.parametrize("fmt", ["sharded", "full"])
@pytest.mark.parametrize("strategy", ["shard_grad_op", "no_shard"])
def test_every_shape_round_trips_exactly_under_other_strategies(pools, tmp_path, strategy, fmt):
    for names in pools(2).run(round_trip, str(tmp_path / "ckpt"), fmt, True, strategy):
        assert names == NAMES
