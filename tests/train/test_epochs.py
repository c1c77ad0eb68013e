"""`--train.epochs`: the step count derived from the training windows and the global batch, the same on
1 and 2 ranks, with the same global batches; the data runs on across epoch boundaries."""

import json
import random

import numpy as np
import pytest
import torch

from shardtrain.train.config import load_config
from shardtrain.train.data import TokenBatches
from shardtrain.train.epochs import epoch_steps, with_epoch_steps
from tests.train.test_cli import TINY, _train_on


def _global_batch(tokens: np.ndarray, step: int, *, world: int, batch: int) -> torch.Tensor:
    """Step `step`'s whole global batch as `world` ranks read it (their slices, in rank order)."""
    order = dict(global_batch=batch, world_size=world, seed=3, shuffle=True)
    slices = [TokenBatches(tokens, seq_len=8, rank=r, **order).batch(step)["input_ids"] for r in range(world)]
    return torch.cat(slices)


def test_epochs_read_the_same_batches_on_one_and_two_ranks_across_epoch_boundaries():
    tokens = np.random.default_rng(0).integers(0, 256, 8 * 37 + 1).astype(np.uint8)  # 37 windows
    steps = epoch_steps(epochs=3, num_windows=37, batch_size=4)
    assert steps == 27  # floor(3 * 37 / 4): the last epoch's final (3 * 37) % 4 = 3 windows are not read
    one = [_global_batch(tokens, s, world=1, batch=4) for s in range(steps)]
    two = [_global_batch(tokens, s, world=2, batch=4) for s in range(steps)]
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    # Step 9 reads samples 36..39: the last window of epoch 0 and the first three of epoch 1.
    windows = {tuple(row.tolist()) for row in torch.cat(one)}
    assert len(windows) == 37  # every window read; each of them 3 times but the 3 the run stops before
    rows = [tuple(row.tolist()) for row in torch.cat(one)]
    assert sorted(rows.count(w) for w in windows) == [2] * 3 + [3] * 34


def test_epochs_too_few_for_one_batch_name_the_least():
    with pytest.raises(ValueError, match=r"train.epochs=0.01 of 100 training windows is fewer than one batch .* 0.16"):
        epoch_steps(epochs=0.01, num_windows=100, batch_size=16)


def test_epochs_replace_steps_and_say_so():
    cfg = load_config(overrides=["--train.epochs", "2.5", "--train.batch_size", "16", "--train.steps", "7"])
    derived, line = with_epoch_steps(cfg, 1000)
    assert derived.train.steps == 156 and cfg.train.steps == 7
    assert line == (
        "train.epochs 2.5 x 1,000 training windows / train.batch_size 16 = 156 optimizer steps "
        "(62 per epoch; train.steps is not used)"
    )
    assert with_epoch_steps(load_config(), 1000) == (load_config(), None)


def test_epoch_run_takes_the_same_steps_and_losses_on_one_and_two_ranks(pools, tmp_path):
    text = tmp_path / "corpus.txt"
    rng = random.Random(0)
    text.write_text(
        "\n".join(" ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(12)) for _ in range(1500))
    )
    common = [*TINY, "--data.path", str(text), "--data.cache_dir", str(tmp_path / "cache"), "--train.epochs", "0.04"]
    common += "--train.log_every 1 --train.eval_every 0 --train.eval_batches 1".split()
    common += ["--run.out_dir", str(tmp_path)]
    outputs = {w: _train_on(pools(w), [*common, "--run.name", f"w{w}"]) for w in (1, 2)}
    lines = {w: next(x for x in out.splitlines() if x.startswith("train.epochs")) for w, out in outputs.items()}
    assert lines[1] == lines[2] and "optimizer steps" in lines[1]
    records = {
        w: [json.loads(r) for r in (tmp_path / f"w{w}" / "metrics.jsonl").read_text().splitlines()] for w in (1, 2)
    }
    losses = {w: [r["loss"] for r in records[w] if r["kind"] == "train"] for w in (1, 2)}
    steps = int(lines[1].split(" = ")[1].split()[0])
    assert len(losses[1]) == len(losses[2]) == steps > 1
    assert losses[1] == pytest.approx(losses[2], rel=1e-4)  # the same batches: only the reduction order differs
