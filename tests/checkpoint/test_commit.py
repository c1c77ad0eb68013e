"""Commit bookkeeping (latest, keep_last, overwrite, stale staging) and the non-tensor content of a
checkpoint (plain values, per-rank objects, random-number generators)."""

from tests.checkpoint.train_save_ranks import rotate_and_overwrite, values_objects_and_rng


def test_latest_rotation_overwrite_and_stale_staging(pools, tmp_path):
    pools(2).run(rotate_and_overwrite, str(tmp_path))


def test_values_objects_and_rng_round_trip(pools, tmp_path):
    pools(2).run(values_objects_and_rng, str(tmp_path / "ckpt"))
