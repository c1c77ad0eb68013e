"""`shardtrain train --train.objective dpo` on the 2-rank pool: a run cut between two log records and resumed
logs the uninterrupted run's losses and DPO metrics (train/log_window.py), and TensorBoard holds the metrics
metrics.jsonl holds."""

import importlib.util

import pytest

from shardtrain.train.dpo_loss import METRIC_NAMES
from tests.train.data_runs import records, replayed
from tests.train.facts import llama_folder, preference_rows, write_jsonl
from tests.train.test_cli import _train_on

pytest.importorskip("datasets")

DPO_KEYS = METRIC_NAMES  # rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/...


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory):
    """Six LoRA DPO steps logged every 3 and saved every 2 ("whole", with TensorBoard), and the same run resumed
    from step 4, inside the window of the record at step 6 ("resumed")."""
    tmp = tmp_path_factory.mktemp("dpo_cli")
    folder = llama_folder(tmp / "model", hidden=32)
    pairs = write_jsonl(preference_rows()[:24], tmp / "pairs.jsonl")
    common = [
        *("--model.pretrained", str(folder), "--data.path", str(pairs), "--data.seq_len", "48"),
        *("--train.objective", "dpo", "--lora.rank", "4", "--data.val_fraction", "0.25", "--optim.lr", "1e-2"),
        *("--train.batch_size", "4", "--train.steps", "6", "--train.log_every", "3", "--train.eval_every", "2"),
        *("--run.checkpoint_every", "2", "--run.out_dir", str(tmp / "runs"), "--run.progress", "false"),
        *("--data.cache_dir", str(tmp / "cache"), "--optim.warmup_steps", "0"),
    ]
    loggers = ["--run.loggers", "tensorboard"] if importlib.util.find_spec("tensorboard") else []
    _train_on(pools(2), [*common, "--run.name", "whole", *loggers])
    cut = tmp / "runs" / "whole" / "checkpoints" / "step_000004"
    _train_on(pools(2), [*common, "--run.name", "resumed", "--resume", str(cut)])
    return tmp / "runs"


def test_a_resume_between_log_records_logs_the_uninterrupted_losses_and_metrics(runs):
    whole = records(runs / "whole")
    keys = ("step", "loss", "grad_norm", "eval_loss", *DPO_KEYS, *(f"eval_{k}" for k in DPO_KEYS))
    replay, original = replayed(whole, records(runs / "resumed"), cut=4, keys=keys)
    assert [r["step"] for r in original] == [4, 6, 6]  # eval 4, then train 6 (steps 4-6) and eval 6
    assert replay == original  # exactly: each rank's window of step 4 came back from the checkpoint
    trained = [r for r in whole if r["kind"] == "train"]
    assert [r["step"] for r in trained] == [3, 6] and trained[-1]["rewards/margins"] != 0.0


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs the 'tensorboard' extra")
def test_tensorboard_holds_the_dpo_metrics_of_metrics_jsonl(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs / "whole" / "tensorboard"))
    events.Reload()
    logged = {
        (tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)
    }  # float32, as TensorBoard stores scalars
    checked = 0
    for record in records(runs / "whole"):
        prefix = {"train": "", "eval": "eval_"}.get(record["kind"])
        if prefix is None:
            continue
        for key in DPO_KEYS:
            name = prefix + key
            assert logged[(f"{record['kind']}/{name}", record["step"])] == pytest.approx(record[name], rel=1e-6)
            checked += 1
    assert checked == 6 * (2 + 4)  # two train records, four evaluations (steps 0, 2, 4, 6)
