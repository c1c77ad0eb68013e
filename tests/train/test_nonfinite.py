"""`train.on_nonfinite`: a NaN loss stops the run before any checkpoint of it, or skips that step on
every rank; `shardtrain train` end to end, the NaN injected by a model factory on rank 1 only."""

import json
import math
from pathlib import Path

from tests.train.test_cli import TINY, _one_file, _records, _train


def _run_with_nan(tmp_path: Path, name: str, *extra: str):
    return _train([*TINY, "--model.name", "tests.train.faulty:nan_llama", "--model.kwargs", "{at: 4, rank: 1}",
                   "--train.steps", "6", "--train.log_every", "3", "--train.eval_every", "0",
                   "--train.eval_batches", "1", "--run.checkpoint_every", "2", "--data.path", str(_one_file(tmp_path)),
                   "--data.cache_dir", str(tmp_path / "cache"), "--run.out_dir", str(tmp_path), "--run.name", name,
                   *extra])


def test_a_nan_loss_stops_before_its_checkpoint(tmp_path):
    run = _run_with_nan(tmp_path, "stop")
    assert run.returncode == 1, run.stdout + run.stderr
    for rank in (0, 1):
        assert (f"shardtrain train: error on rank {rank}: step 4: the training loss is nan on rank 1 and the gradient "
                "norm is nan; stopped before writing any checkpoint of it") in run.stderr, run.stderr
    assert "--train.on_nonfinite skip" in run.stderr and "Traceback" not in run.stderr
    checkpoints = tmp_path / "stop" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000002"]
    assert (checkpoints / "latest").read_text().strip() == "step_000002"


def test_skip_skips_the_step_on_every_rank_and_counts_it(tmp_path):
    run = _run_with_nan(tmp_path, "skip", "--train.on_nonfinite", "skip")
    assert run.returncode == 0, run.stderr
    assert ("shardtrain train: step 4: the training loss is nan on rank 1 and the gradient norm is nan; skipped this "
            "optimizer step on every rank (1 skipped so far)") in run.stderr
    assert "6 (1 skipped: non-finite loss or gradient norm)" in run.stdout
    train = [r for r in _records(tmp_path / "skip") if r["kind"] == "train"]
    assert [(r["step"], r["skipped_steps"]) for r in train] == [(3, 0), (6, 1)]
    assert all(math.isfinite(r["loss"]) for r in train)  # the mean leaves the skipped step out
    evals = [r for r in _records(tmp_path / "skip") if r["kind"] == "eval"]
    assert math.isfinite(evals[-1]["eval_loss"])  # the weights never saw the NaN
    checkpoints = tmp_path / "skip" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000006"
    assert json.loads((checkpoints / "step_000006" / "metadata.json").read_text())["values"]["data"]["step"] == 6
