"""Atomic commit: staging directory, rename, `latest` pointer, rotation, and path resolution.

Ranks write into `<path>.tmp-<token>` next to the final path; once every rank has written and
rank 0 has written metadata.json, rank 0 renames the staging directory to `<path>` (one atomic
rename), then points `<parent>/latest` at it (write + atomic replace) and, with `keep_last`, removes
the oldest checkpoints of the parent. A crash at any moment leaves the last committed checkpoint and
its `latest` pointer as they were; the abandoned staging directory is ignored by loads and removed
by the next save into the same parent.

Overwriting an existing `<path>` moves the old directory aside before the rename and deletes it
after, so between those two renames `<path>` is briefly absent.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable

from .format import LATEST_FILE, METADATA_FILE, created_ns

_STAGING = re.compile(r".+\.tmp-[0-9a-f]{32}$")

# Test seam: called on every rank with (staging directory, rank) once its files are written, before
# the commit. The crash-safety test pauses here and kills the writers.
before_commit_hook: Callable[[Path, int], None] | None = None


def new_token() -> str:
    return uuid.uuid4().hex


def staging_dir(final: Path, token: str) -> Path:
    return final.parent / f"{final.name}.tmp-{token}"


def begin_staging(final: Path, token: str) -> Path:
    """Rank 0: remove stale staging directories of earlier crashed saves, create this one."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(final.parent)
    staging = staging_dir(final, token)
    staging.mkdir()
    return staging


def remove_stale(parent: Path) -> None:
    for child in parent.iterdir():
        if _STAGING.match(child.name) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)  # best effort: the next save retries


def commit(staging: Path, final: Path, *, keep_last: int | None) -> None:
    """Rank 0, after metadata.json is in `staging`: make it the checkpoint at `final`."""
    _fsync_dir(staging)
    aside = None
    if final.exists():
        aside = staging_dir(final, new_token())
        os.rename(final, aside)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside)
    _point_latest(final)
    if keep_last is not None:
        _rotate(final, keep_last)


def _point_latest(final: Path) -> None:
    pointer = final.parent / LATEST_FILE
    temporary = final.parent / f".{LATEST_FILE}.{new_token()}"
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, pointer)
    _fsync_dir(final.parent)


def _rotate(final: Path, keep_last: int) -> None:
    """Keep the `keep_last` newest checkpoints of `final`'s parent (by commit time), `final` included."""
    stamps = {d: created_ns(d) for d in final.parent.iterdir() if d.is_dir() and d != final}
    older = sorted((d for d, t in stamps.items() if t is not None), key=stamps.__getitem__, reverse=True)
    for old in older[keep_last - 1:]:
        trash = staging_dir(old, new_token())
        os.rename(old, trash)  # atomic: a crash mid-delete leaves a stale staging dir, not half a checkpoint
        shutil.rmtree(trash)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory `path` names: itself, or what its `latest` pointer names."""
    path = Path(path)
    if (path / METADATA_FILE).is_file():
        return path
    pointer = path / LATEST_FILE
    if pointer.is_file():
        target = path / pointer.read_text(encoding="utf-8").strip()
        if not (target / METADATA_FILE).is_file():
            raise ValueError(f"{pointer} points to {target.name!r}, which is not a committed checkpoint; pass one "
                             f"of the checkpoint directories in {path} instead")
        return target
    if not path.exists():
        raise ValueError(f"checkpoint path {path} does not exist; pass a directory written by st.save_checkpoint")
    raise ValueError(f"{path} is not a checkpoint: it has neither {METADATA_FILE} nor a {LATEST_FILE!r} pointer; "
                     "pass a directory written by st.save_checkpoint (or the directory holding its 'latest')")
