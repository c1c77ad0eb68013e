"""run.keep_last / run.keep_best on a checkpoints folder, driven by a held-out curve that falls, rises and
falls again; the `best` pointer through a resume and a crash in the middle of a save; early stopping."""

import json
import time
from pathlib import Path

import pytest

from shardtrain.checkpoint import commit
from shardtrain.checkpoint.format import FORMAT_NAME, METADATA_FILE, created_ns
from shardtrain.train.early_stop import EarlyStop
from shardtrain.train.retention import BEST_FILE, SCORES_FILE, Retention, best_checkpoint, checkpoint_name

# held-out loss at the evaluations of steps 10, 20, ... 80: falls to 2.0 (step 30), rises, falls to 1.5 (step 70)
CURVE = {10: 3.0, 20: 2.5, 30: 2.0, 40: 2.2, 50: 2.4, 60: 2.1, 70: 1.5, 80: 1.7}


def _commit(directory: Path, step: int) -> None:
    """A committed checkpoint as save_checkpoint leaves it: a staging folder renamed, `latest` pointed."""
    staging = commit.begin_staging(directory / checkpoint_name(step), commit.new_token())
    (staging / METADATA_FILE).write_text(json.dumps({"format": FORMAT_NAME, "created_ns": time.time_ns()}))
    commit.commit(staging, directory / checkpoint_name(step), keep_last=None)


def _train(directory: Path, steps, **rules) -> Retention:
    retention = Retention(directory, metric="eval_loss", **rules)
    for step in steps:
        _commit(directory, step)
        retention.after_save(step, CURVE.get(step))
    return retention


def _kept(directory: Path) -> list[int]:
    """The steps of the committed checkpoints (a dead save's staging folder is no checkpoint)."""
    return sorted(int(d.name.removeprefix("step_")) for d in directory.iterdir() if created_ns(d) is not None)


def _pointer(directory: Path, name: str) -> str:
    return (directory / name).read_text().strip()


def test_keep_last_and_keep_best_leave_the_newest_and_the_lowest(tmp_path):
    _train(tmp_path, [10, 20, 30, 40, 50, 60], keep_last=2, keep_best=2)
    assert _kept(tmp_path) == [30, 50, 60]  # newest 50, 60; best 30 (2.0) and 60 (2.1)
    _train(tmp_path, [70, 80], keep_last=2, keep_best=3)
    assert _kept(tmp_path) == [30, 70, 80]  # newest 70, 80; best 70 (1.5), 80 (1.7), 30 (2.0)
    assert _pointer(tmp_path, BEST_FILE) == "step_000070" and _pointer(tmp_path, "latest") == "step_000080"
    assert json.loads((tmp_path / SCORES_FILE).read_text()) == {
        "metric": "eval_loss",
        "scores": {"step_000030": 2.0, "step_000070": 1.5, "step_000080": 1.7},
    }


def test_keep_best_alone_keeps_the_best_and_the_newest_for_resuming(tmp_path):
    _train(tmp_path, [10, 20, 30, 40, 50], keep_last=0, keep_best=1)
    assert _kept(tmp_path) == [30, 50] and _pointer(tmp_path, BEST_FILE) == "step_000030"


def test_keep_last_alone_matches_save_checkpoints_rotation(tmp_path):
    _train(tmp_path, [5, 10, 15, 20], keep_last=2, keep_best=0)  # unscored checkpoints (between evaluations)
    assert _kept(tmp_path) == [15, 20] and not (tmp_path / BEST_FILE).exists()


def test_the_best_so_far_survives_a_resume(tmp_path):
    _train(tmp_path, [10, 20, 30, 40], keep_last=1, keep_best=1)
    assert _kept(tmp_path) == [30, 40]
    # a new process (the resumed run) reads scores.json: 2.2 and 2.4 do not beat step 30's 2.0
    resumed = _train(tmp_path, [50, 60], keep_last=1, keep_best=1)
    assert _kept(tmp_path) == [30, 60] and resumed.describe_best() == "step_000030 (eval_loss 2.0000)"
    _train(tmp_path, [70], keep_last=1, keep_best=1)
    assert _kept(tmp_path) == [70] and _pointer(tmp_path, BEST_FILE) == "step_000070"


def test_best_pointer_survives_a_crash_during_a_save_and_the_next_save_recovers(tmp_path, monkeypatch):
    retention = _train(tmp_path, [10, 20, 30, 40], keep_last=1, keep_best=1)

    def crash(staging, rank):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(commit, "before_commit_hook", crash)
    with pytest.raises(KeyboardInterrupt):  # the save of step 50 dies before its commit
        staging = commit.begin_staging(tmp_path / "step_000050", commit.new_token())
        commit.before_commit_hook(staging, 0)
    monkeypatch.setattr(commit, "before_commit_hook", None)
    assert best_checkpoint(tmp_path).name == "step_000030" and _kept(tmp_path) == [30, 40]

    # ...and a crash after the commit, while removing the checkpoints beyond the rules
    def removal_dies(path):
        raise OSError("killed while removing")

    monkeypatch.setattr(commit, "remove", removal_dies)
    _commit(tmp_path, 50)
    with pytest.raises(OSError):
        retention.after_save(50, CURVE[50])
    assert best_checkpoint(tmp_path).name == "step_000030" and _pointer(tmp_path, "latest") == "step_000050"
    monkeypatch.undo()
    _train(tmp_path, [60], keep_last=1, keep_best=1)  # the resumed run removes what was left
    assert _kept(tmp_path) == [30, 60] and best_checkpoint(tmp_path).name == "step_000030"
    assert sorted(d.name for d in tmp_path.iterdir() if d.is_dir()) == ["step_000030", "step_000060"]


def test_a_resume_with_another_metric_is_refused(tmp_path):
    _train(tmp_path, [10], keep_last=1, keep_best=1)
    with pytest.raises(
        ValueError, match="ranks this run's checkpoints by 'eval_loss'; resume with --run.best_metric eval_loss"
    ):
        Retention(tmp_path, keep_last=1, keep_best=1, metric="eval_loss_ema")


def test_exporting_the_best_without_one_says_how(tmp_path):
    with pytest.raises(ValueError, match="has no 'best' pointer"):
        best_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("patience", "min_delta", "stop_step"),
    [(2, 0.0, 50), (3, 0.0, 60), (4, 0.0, None), (1, 0.0, 40), (2, 0.25, 50), (1, 0.6, 20)],
)
def test_early_stop_at_the_step_the_patience_implies(patience, min_delta, stop_step):
    stopper = EarlyStop(patience=patience, min_delta=min_delta, metric="eval_loss")
    reasons = {step: stopper.update(step, loss) for step, loss in CURVE.items()}
    stops = [step for step, reason in reasons.items() if reason]
    assert (stops[0] if stops else None) == stop_step
    if stop_step == 50:
        assert reasons[50] == (
            f"early stop at step 50: eval_loss did not improve by more than {min_delta:g} in 2 evaluations "
            "(best 2.0000 at step 30)"
        )
