"""Timed trials for `engine.strategy = "auto"`: run the best predicted configurations, keep the fastest.

The planner's cost model ranks configurations; `engine.auto_trials = K` checks its ranking on the
real job. The K best configurations predicted to fit each train `TRIAL_STEPS` steps of the same config
in fresh processes (a trial that runs out of memory or fails cannot disturb the next one or the job),
and the job then runs with the one of the highest measured tokens/s. The first step of each trial is
not timed (allocator warm-up, the recorded prefetch order).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..planning.cost.choice import AutoChoice
from ..planning.cost.report import checkpointing_label
from .config import save_config
from .sections import Config

TRIAL_STEPS = 4  # 1 untimed + 3 timed
TRIAL_TIMEOUT_S = 900.0


@dataclass(frozen=True, kw_only=True)
class Trial:
    """One configuration's measurement: tokens/s over the timed steps, or why it produced none."""

    choice: AutoChoice
    tokens_per_s: float | None
    error: str | None = None

    def describe(self) -> str:
        what = (
            f"{self.choice.strategy.value}, checkpointing {checkpointing_label(self.choice.recompute_every)}"
            f"{', CPU offload' if self.choice.cpu_offload else ''}, micro-batch {self.choice.micro_batch} x "
            f"{self.choice.grad_accum}"
        )
        result = f"{self.tokens_per_s:,.0f} tok/s" if self.tokens_per_s is not None else f"failed: {self.error}"
        return f"{what}: predicted {self.choice.relative_step_time:.3f} x the ideal, measured {result}"


def trial_config(cfg: Config, choice: AutoChoice, *, out_dir: Path, name: str) -> Config:
    """`cfg` running `choice` for TRIAL_STEPS steps, logging every step, with no checkpoints, no
    resume and a one-batch evaluation, into `out_dir / name`."""
    from .planned_config import apply_choice

    chosen = apply_choice(cfg, choice)
    return dataclasses.replace(
        chosen,
        train=dataclasses.replace(
            chosen.train, steps=TRIAL_STEPS, epochs=0.0, log_every=1, eval_every=0, eval_batches=1
        ),
        run=dataclasses.replace(
            chosen.run,
            out_dir=str(out_dir),
            name=name,
            checkpoint_every=0,
            resume=None,
            tensorboard=False,
            progress=False,
        ),
    )


def measured_tokens_per_s(metrics: Path) -> float | None:
    """Median tokens/s of the train records after the first step in a run's metrics.jsonl."""
    if not metrics.exists():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in records if r.get("kind") == "train" and r["step"] > 1]
    return statistics.median(rates) if rates else None


def run_trials(cfg: Config, choices: list[AutoChoice], *, timeout_s: float = TRIAL_TIMEOUT_S, log=print) -> list[Trial]:
    """Train each of `choices` briefly in a fresh `shardtrain train` and measure it (see the module doc)."""
    trials = []
    with tempfile.TemporaryDirectory(prefix="shardtrain-trials-") as tmp:
        for index, choice in enumerate(choices):
            name = f"trial-{index}"
            config_path = Path(tmp) / f"{name}.yaml"
            save_config(trial_config(cfg, choice, out_dir=Path(tmp), name=name), config_path)
            trial = _run_one(choice, config_path, Path(tmp) / name / "metrics.jsonl", timeout_s=timeout_s)
            log(f"trial {index + 1}/{len(choices)}: {trial.describe()}")
            trials.append(trial)
    return trials


def _run_one(choice: AutoChoice, config_path: Path, metrics: Path, *, timeout_s: float) -> Trial:
    command = [sys.executable, "-m", "shardtrain", "train", str(config_path)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Trial(choice=choice, tokens_per_s=None, error=f"no result within {timeout_s:.0f} s")
    rate = measured_tokens_per_s(metrics)
    if done.returncode != 0 or rate is None:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = (
            "out of memory"
            if "out of memory" in (done.stderr + done.stdout).lower()
            else (lines[-1][:200] if lines else f"exit code {done.returncode}")
        )
        return Trial(choice=choice, tokens_per_s=None, error=reason)
    return Trial(choice=choice, tokens_per_s=rate)


def fastest(trials: list[Trial]) -> Trial:
    """The trial of the highest measured tokens/s; ValueError naming every failure when none ran."""
    ran = [t for t in trials if t.tokens_per_s is not None]
    if not ran:
        raise ValueError(
            "every timed trial of engine.strategy='auto' failed: "
            + "; ".join(t.describe() for t in trials)
            + ". Set engine.auto_trials 0 to train with the prediction alone, or fix the failure above"
        )
    return max(ran, key=lambda t: t.tokens_per_s)
