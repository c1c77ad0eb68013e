"""Retention across a real kill: `shardtrain train` with keep_last 2 and keep_best 1 is SIGKILLed mid-run
(every rank, wherever it is, a save included), then `--resume` alone finishes the run in its folder. The
folders left are the two newest and the best of both launches' held-out curve (a constant, high learning
rate makes it rise and fall), and `best` points at it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train.test_cli import ROOT, TINY, _records, _train

STEPS = 30


def _kept(run_dir: Path) -> list[int]:
    """The committed checkpoints' steps (a save the kill cut short leaves a `step_N.tmp-...` staging folder)."""
    names = [d.name.removeprefix("step_") for d in (run_dir / "checkpoints").glob("step_*")]
    return sorted(int(name) for name in names if name.isdigit())


@pytest.mark.slow  # two launches of 2 ranks with a save at every evaluation, about 40 s
def test_keep_best_and_keep_last_survive_a_kill_and_resume(tmp_path):
    args = [
        *TINY,
        *("--train.steps", str(STEPS), "--train.eval_every", "2", "--train.log_every", "2"),
        *(
            "--train.eval_batches",
            "1",
            "--optim.lr",
            "0.1",
            "--optim.schedule",
            "constant",
            "--optim.warmup_steps",
            "0",
            "--run.keep_last",
            "2",
            "--run.keep_best",
            "1",
        ),
        *("--run.out_dir", str(tmp_path / "runs"), "--data.cache_dir", str(tmp_path / "cache")),
    ]
    run_dir = tmp_path / "runs" / "k"
    command = [sys.executable, "-m", "shardtrain", "train", *args, "--run.name", "k"]
    job = subprocess.Popen(command, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 150
    try:
        while not (run_dir / "checkpoints" / "step_000026").exists():
            assert job.poll() is None, job.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the run never reached step 26"
            time.sleep(0.05)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the launcher and its ranks
        job.wait(timeout=30)
    killed_at = max(_kept(run_dir))
    assert killed_at < STEPS and (run_dir / "checkpoints" / "best").exists()

    resumed = _train(["--resume", *args])  # `--resume` alone: the latest run of run.out_dir, in its folder
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    scores: dict[int, float] = {}
    for record in _records(run_dir):  # a step evaluated again after the resume counts as the resumed run saw it
        if record["kind"] == "eval" and record["step"] > 0:
            scores[record["step"]] = record["eval_loss"]
    assert max(scores) == STEPS and set(range(2, STEPS + 1, 2)) <= set(scores)
    best = min(scores, key=lambda step: (scores[step], step))
    # the point of the test: the best (step 24 on this curve) was saved before the kill, and the resumed
    # launch, which never evaluated it, still keeps it and points at it
    assert best < killed_at, (best, killed_at, scores)
    assert _kept(run_dir) == sorted({STEPS - 2, STEPS, best})
    assert (run_dir / "checkpoints" / "best").read_text().strip() == f"step_{best:06d}"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:06d}"
    leftovers = [d.name for d in (run_dir / "checkpoints").iterdir() if ".tmp" in d.name]
    assert not leftovers, leftovers
