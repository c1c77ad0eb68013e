"""Several sources in one stream (data/mixing.py): shares, determinism by seed, exact resume, disjoint ranks."""

import numpy as np
import pytest

from shardtrain.data.mixing import BLOCK, MixedBatches, block_counts, shares_of

datasets = pytest.importorskip("datasets")
SEQ = 8


def _windows(n: int, *, first_id: int, trained: int = SEQ):
    """`n` full windows whose ids say where they came from (window w of a source: id first_id + w); the first
    `trained` labels of each trained."""
    ids = [[first_id + w] * SEQ for w in range(n)]
    labels = [[1] * trained + [-100] * (SEQ - trained) for _ in range(n)]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": labels, "position_ids": [list(range(SEQ))] * n})


def _mixed(
    *, weights=(0.7, 0.3), sizes=(50, 50), trained=(SEQ, SEQ // 2), seed=0, rank=0, world_size=1, global_batch=8
):
    parts = [_windows(n, first_id=1000 * (s + 1), trained=t) for s, (n, t) in enumerate(zip(sizes, trained))]
    shares, epoch = shares_of(
        windows=list(sizes),
        trained=[n * t for n, t in zip(sizes, trained)],
        weights=list(weights),
        epochs=[None] * len(sizes),
    )
    return MixedBatches(
        parts,
        names=[f"s{s}" for s in range(len(sizes))],
        shares=shares,
        epoch_samples=epoch,
        seq_len=SEQ,
        pad_id=0,
        global_batch=global_batch,
        rank=rank,
        world_size=world_size,
        seed=seed,
    )


def test_two_sources_at_70_30_train_on_those_shares_of_the_trained_tokens():
    # Equal sizes, and source 1's windows train half their tokens: a plain concatenation would train on
    # 67/33% of the tokens, drawing windows at 70/30 on 82/18%.
    mixed = _mixed()
    for index in range(200):
        mixed.batch(index)
    shares = mixed.trained_tokens / mixed.trained_tokens.sum()
    assert abs(shares[0] - 0.7) <= 0.03 and abs(shares[1] - 0.3) <= 0.03, shares


def test_a_source_is_read_in_passes_over_all_its_windows():
    # Source 1 (30% of the samples) has 20 windows: its first 20 samples are each of them once.
    mixed = _mixed(sizes=(50, 20))
    reads = [int(mixed.batch(i)["input_ids"][b, 0]) for i in range(40) for b in range(8)]
    second = [r - 2000 for r in reads if r >= 2000]
    assert sorted(second[:20]) == list(range(20)) and sorted(second[20:40]) == list(range(20))
    assert second[:20] != second[20:40]  # a new permutation each pass


def test_same_seed_same_batches_and_resume_reads_what_the_uninterrupted_run_read():
    ids = [_mixed(seed=3).batch(i)["input_ids"] for i in range(30)]
    again = _mixed(seed=3)
    assert all((again.batch(i)["input_ids"] == ids[i]).all() for i in range(30))
    resumed = _mixed(seed=3)  # a fresh reader at batch 17, as after --resume
    assert all((resumed.batch(i)["input_ids"] == ids[i]).all() for i in range(17, 30))
    other = _mixed(seed=4)
    assert any((other.batch(i)["input_ids"] != ids[i]).any() for i in range(30))


def test_ranks_read_disjoint_slices_of_the_global_batch():
    whole = _mixed(global_batch=8)
    halves = [_mixed(global_batch=8, rank=r, world_size=2) for r in range(2)]
    for i in (0, 5, BLOCK // 8):  # the last one starts a new block
        joined = np.concatenate([h.batch(i)["input_ids"].numpy() for h in halves])
        assert (joined == whole.batch(i)["input_ids"].numpy()).all()


def test_epoch_counts_weigh_sources_by_epochs_times_windows():
    tokens = dict(windows=[100, 50], trained=[800, 200])
    shares, epoch = shares_of(**tokens, weights=[None, None], epochs=[1.0, 2.0])
    assert shares == [0.5, 0.5] and epoch == 200
    shares, epoch = shares_of(**tokens, weights=[None, None], epochs=[None, None])
    assert shares == pytest.approx([2 / 3, 1 / 3]) and epoch == 150  # unset: 1 epoch each, a concatenation
    # weights 3:1 of the tokens; source 0 trains 8 tokens a window, source 1 4: windows drawn 3/8 : 1/4
    shares, epoch = shares_of(**tokens, weights=[3.0, 1.0], epochs=[None, None])
    assert shares == pytest.approx([0.6, 0.4]) and epoch == 150


def test_block_counts_are_exact_and_a_starved_source_is_named():
    counts = block_counts([0.7, 0.2, 0.1], names=["a", "b", "c"])
    assert counts.sum() == BLOCK and list(counts) == [round(0.7 * BLOCK), round(0.2 * BLOCK), round(0.1 * BLOCK)]
    with pytest.raises(ValueError, match=r"\['tiny'\] have a share under 1/4096"):
        block_counts([1 - 1e-5, 1e-5], names=["big", "tiny"])
