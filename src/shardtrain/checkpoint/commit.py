"""Atomic commit: staging directory, rename, `latest` pointer, rotation, and path resolution.

Ranks write into a staging directory next to the final path, and rank 0 renames it into place (moving
a checkpoint it replaces aside first), then points `<parent>/latest` at it and rotates old ones, so a
crash at any moment leaves exactly one complete checkpoint answering to each name; anything at the
path that is not a shardtrain checkpoint is refused before a byte is written. The steps and what a
crash between them leaves: docs/checkpoint-format.md, "Atomic commit".
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from .format import FORMAT_NAME, LATEST_FILE, METADATA_FILE, created_ns
from .tensorfile import CheckpointWriteError, io_failure, writing

_STAGING = re.compile(r".+\.tmp-[0-9a-f]{32}$")
_ASIDE = re.compile(r"(?P<name>.+)\.old-[0-9a-f]{32}$")

# Test seams. `before_commit_hook(staging, rank)`: on every rank once its files are written, before
# the commit (the crash-safety test pauses here and kills the writers). `commit_hook(point)`: on
# rank 0 at each step of replacing an existing checkpoint: "aside" (the old one moved aside, the new
# one not yet renamed), "renamed" (the new one in place, the old one not yet deleted), "cleaned" (the
# old one deleted, `latest` not yet pointed).
before_commit_hook: Callable[[Path, int], None] | None = None
commit_hook: Callable[[str], None] | None = None


def new_token() -> str:
    return uuid.uuid4().hex


def staging_dir(final: Path, token: str) -> Path:
    return final.parent / f"{final.name}.tmp-{token}"


def aside_dir(final: Path, token: str) -> Path:
    return final.parent / f"{final.name}.old-{token}"


def begin_staging(final: Path, token: str) -> Path:
    """Rank 0: finish or undo what an interrupted save left, refuse a `final` that is not ours to
    replace, and create this save's staging directory."""
    _make_parent(final)
    recover(final.parent)
    check_target(final)
    remove_stale(final.parent)
    staging = staging_dir(final, token)
    staging.mkdir()
    return staging


def _make_parent(final: Path) -> None:
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (final.parent, *final.parent.parents) if p.exists() and not p.is_dir()), None)
        raise ValueError(
            f"cannot save the checkpoint {final}: {blocker or final.parent} is a file, not a directory; "
            "pass a path under a directory"
        ) from None


def check_target(final: Path) -> None:
    """Refuse to save over anything but a shardtrain checkpoint (or an empty directory): replacing it
    would delete it."""
    if not final.exists() and not final.is_symlink():
        return
    if not final.is_dir():
        raise ValueError(
            f"cannot save the checkpoint at {final}: it is an existing file, which saving would "
            "replace; pass a new path, or move the file away"
        )
    if created_ns(final) is None and any(final.iterdir()):
        raise ValueError(
            f"cannot save the checkpoint at {final}: it is an existing directory that is not a "
            f"shardtrain checkpoint (no {METADATA_FILE} of format {FORMAT_NAME!r}), which saving "
            f"would replace; pass a new path such as {final / 'checkpoint'}"
        )


def recover(parent: Path) -> None:
    """Put back each checkpoint an interrupted save had moved aside, unless its replacement was
    committed under its name (then the aside copy is deleted)."""
    asides = [(m["name"], child) for child in parent.iterdir() if (m := _ASIDE.match(child.name)) and child.is_dir()]
    for name, aside in sorted(asides, key=lambda item: created_ns(item[1]) or 0, reverse=True):
        original = parent / name
        if not original.exists() and created_ns(aside) is not None:
            os.rename(aside, original)
            _fsync_dir(parent)
        else:
            shutil.rmtree(aside)


def remove_stale(parent: Path) -> None:
    for child in parent.iterdir():
        if _STAGING.match(child.name) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)  # best effort: the next save retries


def commit(staging: Path, final: Path, *, keep_last: int | None) -> None:
    """Rank 0, after metadata.json is in `staging`: make it the checkpoint at `final`. An I/O error
    raises a `CheckpointWriteError` that says which of the checkpoint, `latest` and the rotation were
    written."""
    with writing(final):
        _fsync_dir(staging)
        if final.is_dir() and not final.is_symlink() and not any(final.iterdir()):
            final.rmdir()  # an empty directory holds nothing to keep
        if final.exists():
            aside = aside_dir(final, new_token())
            os.rename(final, aside)
            _fsync_dir(final.parent)
            _reached("aside")
            os.rename(staging, final)
            _fsync_dir(final.parent)
            _reached("renamed")
            shutil.rmtree(aside)
            _reached("cleaned")
        else:
            os.rename(staging, final)
            _fsync_dir(final.parent)
    pointer = final.parent / LATEST_FILE
    try:
        point(final, LATEST_FILE)
    except OSError as exc:
        named = pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else None
        still = f"it still names {named!r}" if named else "it does not exist"
        then = f"then load {final} by its path or save again"
        raise _committed_but(exc, final, f"could not point {pointer} at it ({still})", then) from exc
    if keep_last is not None:
        try:
            _rotate(final, keep_last)
        except OSError as exc:
            what = f"could not remove the checkpoints beyond keep_last={keep_last}"
            raise _committed_but(exc, final, what, f"then remove them from {final.parent}") from exc


def _committed_but(exc: OSError, final: Path, what: str, then: str) -> CheckpointWriteError:
    reason, remedy = io_failure(exc)
    return CheckpointWriteError(
        exc.errno, f"the checkpoint {final} is complete, but the save {what}: {reason}; {remedy}, {then}"
    )


def _reached(point: str) -> None:
    if commit_hook is not None:
        commit_hook(point)


def point(final: Path, name: str) -> None:
    """Make `<final's parent>/<name>` (a pointer file such as `latest`) name `final`: a temporary
    file, fsynced, then one atomic replace, so a crash leaves the old pointer or the new one."""
    pointer = final.parent / name
    temporary = final.parent / f".{name}.{new_token()}"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(final.name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, pointer)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)  # a full disk still lets a file go
        raise
    _fsync_dir(final.parent)


def _rotate(final: Path, keep_last: int) -> None:
    """Keep the `keep_last` newest checkpoints of `final`'s parent (by commit time), `final` included."""
    stamps = {d: t for d in final.parent.iterdir() if d.is_dir() and d != final and (t := created_ns(d)) is not None}
    older = sorted(stamps, key=stamps.__getitem__, reverse=True)
    for old in older[keep_last - 1 :]:
        remove(old)


def remove(checkpoint: Path) -> None:
    """Delete a checkpoint directory: one atomic rename first, so a crash mid-delete leaves a stale
    staging directory (removed by the next save), never half a checkpoint under its name."""
    trash = staging_dir(checkpoint, new_token())
    os.rename(checkpoint, trash)
    shutil.rmtree(trash)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _committed(directory: Path) -> Path | None:
    """`directory` if it holds a checkpoint; while a save over it is interrupted between its two
    renames, the old checkpoint it moved aside; else None."""
    if (directory / METADATA_FILE).is_file():
        return directory
    if directory.exists() or not directory.parent.is_dir():
        return None
    asides = [
        child
        for child in directory.parent.iterdir()
        if (m := _ASIDE.match(child.name)) and m["name"] == directory.name and created_ns(child) is not None
    ]
    return max(asides, key=lambda child: created_ns(child) or 0, default=None)


def _pointed(path: Path, pointer: Path) -> Path:
    """The directory `pointer` names, which must be a checkpoint directly inside `path`."""
    name = pointer.read_text(encoding="utf-8").strip()
    target = path / name
    if name in ("", ".", "..") or Path(name).name != name or target.resolve().parent != path.resolve():
        raise ValueError(
            f"{pointer} names {name!r}, which is not a directory inside {path}; a {LATEST_FILE!r} "
            f"pointer holds the name of one checkpoint next to it: fix the file or pass the "
            "checkpoint directory itself"
        )
    found = _committed(target)
    if found is None:
        raise ValueError(
            f"{pointer} points to {name!r}, which is not a committed checkpoint; pass one "
            f"of the checkpoint directories in {path} instead"
        )
    return found


def pointed(directory: Path, name: str) -> Path:
    """The committed checkpoint that the pointer file `<directory>/<name>` (e.g. `best`) names."""
    return _pointed(directory, directory / name)


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory `path` names: itself, or what its `latest` pointer names."""
    path = Path(path)
    found = _committed(path)
    if found is not None:
        return found
    if path.is_file():
        raise ValueError(_file_given(path))
    pointer = path / LATEST_FILE
    if pointer.is_file():
        return _pointed(path, pointer)
    if not path.exists():
        raise ValueError(f"checkpoint path {path} does not exist; pass a directory written by st.save_checkpoint")
    raise ValueError(
        f"{path} is not a checkpoint: it has neither {METADATA_FILE} nor a {LATEST_FILE!r} pointer; "
        "pass a directory written by st.save_checkpoint (or the directory holding its 'latest')"
    )


def _file_given(path: Path) -> str:
    """The error for a checkpoint path that is a file: name the directory to pass where it is clear."""
    if path.name == METADATA_FILE:
        return (
            f"checkpoint path {path} is a file, the {METADATA_FILE} of a checkpoint; pass its directory {path.parent}"
        )
    if path.name == LATEST_FILE:
        return f"checkpoint path {path} is a file, a {LATEST_FILE!r} pointer; pass its directory {path.parent}"
    return f"checkpoint path {path} is a file; pass a directory written by st.save_checkpoint (or the one holding its 'latest')"
