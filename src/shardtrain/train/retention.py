"""run.keep_last / run.keep_best: which of a run's checkpoints stay, and the `best` pointer beside `latest`.

After each checkpoint of the run is committed (checkpoint/commit.py: staging directory, one rename,
`latest`), rank 0 (1) records the held-out scores of the checkpoints it keeps in
checkpoints/scores.json (written aside, then one atomic replace), (2) points checkpoints/best at the best-scoring checkpoint (the same atomic pointer
write as `latest`), and (3) removes the checkpoints kept by neither rule (each by one rename, then
deletion). A crash at any moment leaves `best` naming a committed checkpoint: a checkpoint is pointed
at only once committed, and removed only once no pointer names it. scores.json lives in the run
folder, so a resumed run keeps ranking against the best of the runs before it.

Kept: the `keep_last` newest checkpoints (by commit time, as `latest` goes; 0: all of them, or only
the newest when keep_best is on, which a resume needs) and the `keep_best` lowest-scoring ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..checkpoint import commit
from ..checkpoint.format import created_ns
from .finetune import checkpoint_params

SCORES_FILE = "scores.json"
BEST_FILE = "best"


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


class Retention:
    """The retention rules of one run's checkpoints directory (rank 0 only)."""

    def __init__(self, directory: Path, *, keep_last: int, keep_best: int, metric: str) -> None:
        self.directory = directory
        self.keep_last = keep_last if keep_last or not keep_best else 1
        self.keep_best = keep_best
        self.metric = metric
        self.scores = self._read_scores()

    def _read_scores(self) -> dict[str, float]:
        path = self.directory / SCORES_FILE
        if not path.is_file():
            return {}
        stored = json.loads(path.read_text(encoding="utf-8"))
        if stored["metric"] != self.metric:
            raise ValueError(
                f"run.best_metric={self.metric!r}, but {path} ranks this run's checkpoints by "
                f"{stored['metric']!r}; resume with --run.best_metric {stored['metric']}"
            )
        return {name: float(score) for name, score in stored["scores"].items()}

    def after_save(self, step: int, score: float | None) -> None:
        """Checkpoint `step` was just committed with held-out `score` (None: saved between evaluations)."""
        name = checkpoint_name(step)
        self.scores.pop(name, None)  # a checkpoint saved over an older one at its step: the old score is gone
        if score is not None:
            self.scores[name] = score
        present = {d.name: t for d in self.directory.iterdir() if d.is_dir() and (t := created_ns(d)) is not None}
        self.scores = {n: s for n, s in self.scores.items() if n in present}
        best = self.best()
        newest = sorted(present, key=present.__getitem__, reverse=True)
        kept = set(newest[: self.keep_last] if self.keep_last else newest) | set(best)
        # a checkpoint left out now is never kept later (newer ones come, the best only get better)
        self.scores = {n: s for n, s in self.scores.items() if n in kept}
        self._write_scores()
        if best:
            commit.point(self.directory / best[0], BEST_FILE)
        for name in newest:
            if name not in kept:
                commit.remove(self.directory / name)

    def best(self) -> list[str]:
        """The names of the `keep_best` best-scoring checkpoints, best first (ties: the earlier step)."""
        return sorted(self.scores, key=lambda n: (self.scores[n], n))[: self.keep_best]

    def describe_best(self) -> str | None:
        """'step_000040 (eval_loss 1.2345)', or None before any checkpoint is scored."""
        best = self.best()
        return f"{best[0]} ({self.metric} {self.scores[best[0]]:.4f})" if best else None

    def _write_scores(self) -> None:
        path = self.directory / SCORES_FILE
        temporary = path.with_name(f".{SCORES_FILE}.{commit.new_token()}")
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump({"metric": self.metric, "scores": self.scores}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)


def best_checkpoint(directory: Path) -> Path:
    """The checkpoint that `directory`'s `best` pointer names; ValueError if there is none."""
    if not (directory / BEST_FILE).is_file():
        raise ValueError(
            f"{directory} has no {BEST_FILE!r} pointer: no checkpoint was scored (run.keep_best keeps and "
            "points at the best, saving one at each evaluation); export the last with --run.export last"
        )
    return commit.pointed(directory, BEST_FILE)


def load_best(job, run_dir: Path) -> str:
    """run.export best: load the best checkpoint's weights into `job.model` (every rank); a line naming it.
    Rank 0 reads the pointer (it wrote it) and tells the others."""
    engine = job.engine
    found = None
    if engine.rank == 0:
        try:
            found = str(best_checkpoint(run_dir / "checkpoints"))
        except ValueError as exc:
            found = exc
    found = engine.broadcast(found)
    if isinstance(found, ValueError):
        raise found
    engine.load(found, {"model": job.model}, params=checkpoint_params(job.cfg))
    return f"the best checkpoint {found}"
