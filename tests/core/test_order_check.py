"""Ranks that run different units stop at once, every one of them, with the units named."""

import pytest

from tests.core import diverge


def _assert_named(results, *needles):
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} trained on"
        assert r["seconds"] < 60, r
        for needle in ("rank 0:", "rank 1:", "took different paths", *needles):
            assert needle in r["error"], (needle, r["error"])


def test_a_block_skipped_on_one_rank(pools):
    # unequal counts: without the check this hangs, or Gloo fails with "Received data size doesn't match"
    _assert_named(pools(2).run(diverge.skipped_blocks, [[], [1]]), "'layers.1'")


def test_different_blocks_skipped_on_each_rank(pools):
    # equal counts and sizes: without the check this trains silently wrong
    _assert_named(pools(2).run(diverge.skipped_blocks, [[3], [2]]), "'layers.2'", "'layers.3'")


def test_an_expert_without_tokens_on_one_rank(pools):
    _assert_named(pools(2).run(diverge.moe_with_an_idle_expert), "'experts.")


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_the_same_path_on_every_rank_trains(pools, world):
    for r in pools(world).run(diverge.skipped_blocks, [[1]] * world):
        assert r["error"] is None, r
