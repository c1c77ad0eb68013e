"""Timed trials of engine.strategy='auto': the runner-ups, the measurement, and an end-to-end run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardtrain.planning.cost.auto import choose_plan
from shardtrain.train.config import ConfigError, load_config
from shardtrain.train.trials import TRIAL_STEPS, Trial, fastest, measured_tokens_per_s, trial_config

ROOT = Path(__file__).resolve().parents[2]


def test_runners_up_follow_the_predicted_order():
    choice = choose_plan("8b", world_size=2, device_memory="141GB", seq_len=4096, micro_batch=2)
    alternatives = choice.alternatives()
    assert alternatives[0] is choice and len(alternatives) == 5
    times = [a.step_time.total for a in alternatives]
    assert times == sorted(times)
    assert all(a.predicted_bytes <= a.usable_memory for a in alternatives)
    assert alternatives[1].reasons[0].startswith("runner-up 1 of the prediction")


def test_measured_rate_skips_the_first_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"kind": "eval", "step": 0}, {"kind": "train", "step": 1, "tokens_per_s": 1.0}]
    rows += [{"kind": "train", "step": s, "tokens_per_s": r} for s, r in [(2, 10.0), (3, 30.0), (4, 20.0)]]
    metrics.write_text("\n".join(json.dumps(r) for r in rows))
    assert measured_tokens_per_s(metrics) == 20.0
    assert measured_tokens_per_s(tmp_path / "missing.jsonl") is None


def test_fastest_and_all_failed():
    choice = choose_plan("1.5b", world_size=2, device_memory="141GB", seq_len=4096, micro_batch=1)
    slow, quick = Trial(choice=choice, tokens_per_s=10.0), Trial(choice=choice, tokens_per_s=12.0)
    failed = Trial(choice=choice, tokens_per_s=None, error="out of memory")
    assert fastest([slow, failed, quick]) is quick
    with pytest.raises(ValueError, match="every timed trial.*out of memory.*auto_trials 0"):
        fastest([failed])


def test_trial_config_is_short_and_private(tmp_path):
    cfg = load_config(
        None,
        [
            "--model.name",
            "llama-8b",
            "--engine.devices",
            "2",
            "--engine.strategy",
            "auto",
            "--run.checkpoint_every",
            "100",
            "--train.steps",
            "1000",
        ],
    )
    choice = choose_plan("8b", world_size=2, device_memory="141GB", seq_len=cfg.data.seq_len, micro_batch=1)
    trial = trial_config(cfg, choice, out_dir=tmp_path, name="trial-0")
    assert trial.engine.strategy == choice.strategy.value and trial.train.steps == TRIAL_STEPS
    assert trial.run.checkpoint_every == 0 and trial.run.out_dir == str(tmp_path) and trial.run.name == "trial-0"
    assert trial.train.log_every == 1 and trial.run.resume is None


def test_negative_trials_rejected():
    with pytest.raises(ConfigError, match="engine.auto_trials"):
        load_config(None, ["--engine.auto_trials", "-1"])


@pytest.mark.slow
def test_auto_with_trials_trains_with_the_fastest_measured(tmp_path):
    args = [
        "--model.name",
        "llama-tiny",
        "--data.seq_len",
        "64",
        "--train.batch_size",
        "8",
        "--run.progress",
        "false",
        "--train.steps",
        "3",
        "--engine.strategy",
        "auto",
        "--engine.auto_trials",
        "2",
        "--engine.accelerator",
        "cpu",
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--run.out_dir",
        str(tmp_path),
        "--run.name",
        "job",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "shardtrain", "train", *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    trials = [line for line in run.stdout.splitlines() if line.startswith("trial ")]
    assert [t.split(":")[0] for t in trials] == ["trial 1/2", "trial 2/2"]
    rates = [float(t.rsplit("measured ", 1)[1].split(" tok/s")[0].replace(",", "")) for t in trials]
    assert min(rates) > 0
    chosen = next(line for line in run.stdout.splitlines() if line.startswith("training with the fastest measured"))
    assert f"{max(rates):,.0f} tok/s" in chosen
    # The job itself ran with the chosen configuration and its own run directory.
    assert (tmp_path / "job" / "metrics.jsonl").exists() and not (tmp_path / "trial-0").exists()
