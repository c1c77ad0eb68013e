"""`shardtrain train` with trackers, retention and early stopping on the 2-rank pool, then `--resume` alone
continuing the same run folder: the kept checkpoints, the `best` pointer and the trackers' records are
checked against the run's own metrics.jsonl."""

from pathlib import Path

import pytest

from shardtrain.train.resume import resolve_resume
from tests.train.test_cli import TINY, _records
from tests.train.tracking_ranks import train_with_env

ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def _train_on(pool, args: list[str]) -> tuple[str, str]:
    results = pool.run(train_with_env, ENV, args)
    assert [code for code, _, _ in results] == [0] * len(results), [err for _, _, err in results]
    return results[0][1], results[0][2]


def _kept(run_dir: Path) -> list[int]:
    return sorted(int(d.name.removeprefix("step_")) for d in (run_dir / "checkpoints").glob("step_*"))


def test_retention_early_stop_trackers_and_resume_of_the_latest_run(pools, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    common = [
        *TINY,
        *("--train.steps", "12", "--train.eval_every", "2", "--train.log_every", "2", "--train.eval_batches", "1"),
        *("--run.keep_last", "2", "--run.keep_best", "1", "--run.out_dir", str(tmp_path / "runs")),
        *("--data.cache_dir", str(tmp_path / "cache"), "--run.loggers", "wandb,mlflow", "--run.mlflow_uri", uri),
    ]
    # No evaluation beats the first by 100 nats: patience 2 stops at the second evaluation after step 0.
    out, _ = _train_on(
        pools(2),
        [*common, "--run.name", "a", "--train.early_stop_patience", "2", "--train.early_stop_min_delta", "100"],
    )
    run_dir = tmp_path / "runs" / "a"
    summary = _records(run_dir)[-1]
    assert summary["kind"] == "summary" and summary["stop_step"] == 4 and summary["step"] == 4
    assert summary["stop_reason"].startswith("early stop at step 4: eval_loss did not improve by more than 100")
    assert "stopped" in out and "early stop at step 4" in out
    assert _kept(run_dir) == [2, 4] and (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000004"

    # `--resume` alone: the latest run of run.out_dir, continued in its folder
    _train_on(pools(2), ["--resume", *common])
    records = _records(run_dir)
    assert [r["step"] for r in records if r["kind"] == "summary"] == [4, 12]
    scores = {r["step"]: r["eval_loss"] for r in records if r["kind"] == "eval" and r["step"] > 0}
    assert sorted(scores) == [2, 4, 6, 8, 10, 12]
    best = min(scores, key=lambda step: (scores[step], step))  # ranked across both launches
    assert _kept(run_dir) == sorted({10, 12, best})
    assert (run_dir / "checkpoints" / "best").read_text().strip() == f"step_{best:06d}"
    assert records[-1]["best_checkpoint"] == f"step_{best:06d} (eval_loss {scores[best]:.4f})"

    # each launch is one MLflow run and one W&B offline run, holding the run's held-out curve
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the file store the logger asked for
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("shardtrain").experiment_id], order_by=["start_time"])
    assert [r.info.run_name for r in runs] == ["a", "a"] and runs[0].data.tags["stop_reason"] == summary["stop_reason"]
    evals = {m.step: m.value for m in client.get_metric_history(runs[1].info.run_id, "eval/eval_loss")}
    assert evals == {step: pytest.approx(loss) for step, loss in scores.items() if step >= 4}
    assert client.get_run(runs[1].info.run_id).data.params["run.keep_best"] == "1"
    assert len(list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))) == 2
    plans = [path.read_text() for path in (tmp_path / "mlruns").rglob("plan.txt")]
    assert len(plans) == 2 and all("== wrap plan ==" in p and "== memory estimate per device ==" in p for p in plans)


def test_a_resume_path_inside_a_run_keeps_that_run_unless_named(tmp_path):
    from shardtrain.train.config import load_config

    checkpoint = tmp_path / "runs" / "a" / "checkpoints" / "step_000004"
    cfg = resolve_resume(load_config(None, ["--run.resume", str(checkpoint)]))
    assert (cfg.run.name, cfg.run.out_dir, cfg.run.resume) == ("a", str(tmp_path / "runs"), str(checkpoint))
    named = resolve_resume(load_config(None, ["--run.resume", str(checkpoint), "--run.name", "b"]))
    assert (named.run.name, named.run.out_dir) == ("b", "runs")
    checkpoint.parent.mkdir(parents=True)
    whole = resolve_resume(load_config(None, ["--run.resume", str(tmp_path / "runs" / "a")]))  # the run folder
    assert (whole.run.resume, whole.run.name) == (str(checkpoint.parent), "a")


def test_resume_latest_without_a_run_says_where_it_looked(tmp_path):
    from shardtrain.train.config import load_config

    with pytest.raises(ValueError, match=f"run.resume='latest': no run in '{tmp_path}' has a checkpoint"):
        resolve_resume(load_config(None, ["--run.resume", "latest", "--run.out_dir", str(tmp_path)]))


def test_an_interrupted_run_stops_early_where_the_uninterrupted_one_does(pools, tmp_path):
    """The stopper's count and best travel in the checkpoint: a run cut at step 4 and resumed stops at
    step 6, as the uninterrupted run does (a fresh count after the resume would stop at step 10)."""
    common = [
        *TINY,
        *("--train.eval_every", "2", "--train.log_every", "2", "--train.eval_batches", "1"),
        *("--run.checkpoint_every", "2", "--run.out_dir", str(tmp_path / "runs")),
        *("--data.cache_dir", str(tmp_path / "cache"), "--run.progress", "false"),
        *("--train.early_stop_patience", "3", "--train.early_stop_min_delta", "100"),
    ]
    _train_on(pools(2), [*common, "--train.steps", "12", "--run.name", "whole"])
    _train_on(pools(2), [*common, "--train.steps", "4", "--run.name", "cut"])
    _train_on(pools(2), [*common, "--train.steps", "12", "--resume", str(tmp_path / "runs" / "cut" / "checkpoints")])
    for name in ("whole", "cut"):
        summary = _records(tmp_path / "runs" / name)[-1]
        assert summary["stop_step"] == 6, (name, summary)
