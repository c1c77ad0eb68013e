"""Fused AdamW's step counts as DTensors on the ("dp", "tp") mesh (core/replicated_steps.py)."""

from __future__ import annotations

from tests.tp.parity_ranks import fused_counts


def test_fused_counts_are_replicated_dtensors_and_change_nothing(pools, tmp_path):
    assert pools(2).run(fused_counts, str(tmp_path / "ckpt")) == [1, 1]
