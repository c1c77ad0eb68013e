"""A model built on the meta device, split by tp_plan and sharded over dp (tests/tp/meta_init.py)."""

from __future__ import annotations

from .meta_init import meta_init_matches_one_d


def test_meta_init_with_tensor_parallel_two_ranks(pools):
    assert pools(2).run(meta_init_matches_one_d, (1, 2)) == [1, 1]
