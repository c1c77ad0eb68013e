"""run.resume: which checkpoint a resumed run loads, and which run folder it goes on writing.

`latest` (also `shardtrain train --resume` with no path) is the run in run.out_dir whose `latest`
checkpoint was committed last. A checkpoint under runs/NAME/checkpoints (or runs/NAME itself) keeps
the run in runs/NAME, metrics.jsonl appended, unless run.name names another run. Every rank resolves
it alike from the files, before any collective.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..checkpoint.commit import resolve
from ..checkpoint.format import LATEST_FILE, created_ns
from .sections import Config

LATEST_RUN = "latest"
CHECKPOINTS = "checkpoints"


def latest_run(out_dir: Path) -> Path:
    """The checkpoints folder of the run in `out_dir` that committed a checkpoint last."""
    found = {}
    for checkpoints in out_dir.glob(f"*/{CHECKPOINTS}"):
        if (checkpoints / LATEST_FILE).is_file():
            try:
                found[checkpoints] = created_ns(resolve(checkpoints)) or 0
            except ValueError:
                continue  # a dangling pointer: not a run to continue
    if not found:
        raise ValueError(
            f"run.resume={LATEST_RUN!r}: no run in {str(out_dir)!r} has a checkpoint; pass --run.out_dir "
            "where the runs are, or a checkpoint path (runs/<name>/checkpoints/step_N)"
        )
    return max(found, key=found.__getitem__)


def resolve_resume(cfg: Config) -> Config:
    """`cfg` with run.resume a checkpoint path, and run.name / run.out_dir those of the run it continues
    (where run.name is not given and the checkpoint lies in a run folder)."""
    if cfg.run.resume is None:
        return cfg
    path = latest_run(Path(cfg.run.out_dir)) if cfg.run.resume == LATEST_RUN else Path(cfg.run.resume)
    if (path / CHECKPOINTS).is_dir():  # the run folder itself
        path = path / CHECKPOINTS
    run_folder = path.parent if path.name == CHECKPOINTS else path.parent.parent
    changes: dict = {"resume": str(path)}
    if cfg.run.name is None and CHECKPOINTS in (path.name, path.parent.name):
        changes.update(name=run_folder.name, out_dir=str(run_folder.parent))
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, **changes))
