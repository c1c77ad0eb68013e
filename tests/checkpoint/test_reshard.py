"""Save at N ranks, load at M: parameters and optimizer state equal the saved ones, and training
continues with the losses of an unsharded reference started from the same state."""

import pytest

from tests.checkpoint.train_save_ranks import load_resharded, save_trained

CASES = [
    # (save world, save strategy, format, load world); hybrid_shard: 2 replicas x 2 shards
    (2, "full_shard", "sharded", 3),
    (3, "full_shard", "sharded", 2),
    (4, "full_shard", "sharded", 1),
    (1, "full_shard", "sharded", 4),
    (2, "no_shard", "sharded", 3),  # replicas: only rank 0 writes
    (4, "hybrid_shard", "sharded", 2),  # only the first replica writes
    (2, "full_shard", "full", 3),
]


@pytest.mark.parametrize(
    "save_world,strategy,fmt,load_world",
    [
        pytest.param(
            *case,
            id=f"{case[0]}-{case[1]}-{case[2]}-to-{case[3]}",
            marks=[pytest.mark.slow] if 4 in (case[0], case[3]) else [],
        )  # 4 ranks: the slow tier
        for case in CASES
    ],
)
def test_load_at_another_world_size(pools, tmp_path, save_world, strategy, fmt, load_world):
    directory = str(tmp_path / "ckpt")
    mesh = (2, 2) if strategy == "hybrid_shard" else None
    params, optim_state = pools(save_world).run(save_trained, directory, strategy, fmt, mesh)[0]
    losses = pools(load_world).run(load_resharded, directory, params, optim_state)
    assert len(losses) == load_world
