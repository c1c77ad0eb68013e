"""`train.on_nonfinite`: a NaN loss stops the run before any checkpoint of it (`shardtrain train` end to
end), or skips that step on every rank (the loop on a pool); the NaN comes from a model factory, on
rank 1 only."""

import contextlib
import io
import json
import math

from rich.console import Console

from shardtrain.engine import Engine
from shardtrain.train.config import load_config
from shardtrain.train.loop import run
from tests.train.test_cli import TINY, _on_one_file, _one_file, _records, _train

# A NaN loss at step 4 on rank 1; checkpoints every 2 steps, the loss logged every 3.
FAULT = [
    "--model.name",
    "tests.train.faulty:nan_llama",
    "--model.kwargs",
    "{at: 4, rank: 1}",
    "--train.steps",
    "6",
    "--train.log_every",
    "3",
    "--train.eval_every",
    "0",
    "--train.eval_batches",
    "1",
    "--run.checkpoint_every",
    "2",
]


def test_a_nan_loss_stops_before_its_checkpoint(tmp_path):
    run = _train(
        [
            *TINY,
            *FAULT,
            *_on_one_file(tmp_path),
            "--run.name",
            "stop",
        ]
    )
    assert run.returncode == 1, run.stdout + run.stderr
    for rank in (0, 1):
        assert (
            f"shardtrain train: error on rank {rank}: step 4: the training loss is nan on rank 1 and the gradient "
            "norm is nan; stopped before writing any checkpoint of it"
        ) in run.stderr, run.stderr
    assert "--train.on_nonfinite skip" in run.stderr and "Traceback" not in run.stderr
    checkpoints = tmp_path / "stop" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000002"]
    assert (checkpoints / "latest").read_text().strip() == "step_000002"


def _train_skipping_nan(corpus: str, directory: str) -> dict:
    """On a pool rank: the same NaN at step 4 on rank 1, under train.on_nonfinite=skip."""
    engine = Engine(accelerator="cpu")
    engine.launch()
    cfg = load_config(
        None,
        [
            *TINY,
            *FAULT,
            "--train.on_nonfinite",
            "skip",
            "--data.path",
            corpus,
            "--data.cache_dir",
            f"{directory}/cache",
            "--run.out_dir",
            directory,
            "--run.name",
            "skip",
        ],
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        summary = run(cfg, engine)
    table = io.StringIO()
    Console(file=table, width=200).print(summary.table())
    return {"stderr": err.getvalue(), "skipped": summary.skipped_steps, "table": table.getvalue()}


def test_skip_skips_the_step_on_every_rank_and_counts_it(pools, tmp_path):
    out = pools(2).run(_train_skipping_nan, str(_one_file(tmp_path)), str(tmp_path))
    assert out[0]["stderr"] == (
        "shardtrain train: step 4: the training loss is nan on rank 1 and the gradient norm is "
        "nan; skipped this optimizer step on every rank (1 skipped so far)\n"
    )
    assert out[1]["stderr"] == "" and out[0]["skipped"] == out[1]["skipped"] == 1
    assert "6 (1 skipped: non-finite loss or gradient norm)" in out[0]["table"]
    records = _records(tmp_path / "skip")
    train = [r for r in records if r["kind"] == "train"]
    assert [(r["step"], r["skipped_steps"]) for r in train] == [(3, 0), (6, 1)]
    assert all(math.isfinite(r["loss"]) for r in train)  # the mean leaves the skipped step out
    evals = [r for r in records if r["kind"] == "eval"]
    assert math.isfinite(evals[-1]["eval_loss"])  # the weights never saw the NaN
    checkpoints = tmp_path / "skip" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000006"
    assert json.loads((checkpoints / "step_000006" / "metadata.json").read_text())["values"]["data"]["step"] == 6
