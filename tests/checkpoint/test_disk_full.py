"""A full disk during a save: every rank raises an error naming the file and the remedy, the last
checkpoint and its `latest` pointer are untouched, and the partial files are removed."""

import errno
import re
from pathlib import Path

import pytest
import torch.distributed as dist

import shardtrain as st
from shardtrain.checkpoint import save as save_module
from shardtrain.checkpoint import tensorfile
from tests.checkpoint.train_save_ranks import build, state


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


class _FullDisk:
    """A file opened for writing on a full disk: it opens, and the first write fails."""

    def __init__(self, file):
        self._file = file
        self.write = _no_space

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


def _open_on_full_disk(path, mode="r", *args, **kwargs):
    file = open(path, mode, *args, **kwargs)
    return _FullDisk(file) if "w" in mode else file


def _full_disk_on(where: str, directory: str) -> list[str]:
    """Save step1, then step2 with the disk full on one rank at `where`; return this rank's message."""
    run = Path(directory) / "run"
    model, optimizer, scheduler = build()
    st.save_checkpoint(run / "step1", state(model, optimizer, scheduler, step=1))
    rank = dist.get_rank()
    failing_rank, target, attr, replacement = {
        "shard": (1, tensorfile, "open", _open_on_full_disk),
        "metadata": (0, save_module, "write_metadata", _no_space),
    }[where]
    original = getattr(target, attr, None)
    if rank == failing_rank:
        setattr(target, attr, replacement)
    try:
        with pytest.raises((OSError, RuntimeError)) as info:
            st.save_checkpoint(run / "step2", state(model, optimizer, scheduler, step=2))
    finally:
        if original is None:
            target.__dict__.pop(attr, None)
        else:
            setattr(target, attr, original)
    dist.barrier()
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step1"]
    assert (run / "latest").read_text().strip() == "step1"
    fresh = build(seed=1)
    assert st.load_checkpoint(run, state(*fresh))["step"] == 1
    return [type(info.value).__name__, str(info.value)]


@pytest.mark.parametrize(
    "where, file, failing_rank", [("shard", "model-00001-of-00002.safetensors", 1), ("metadata", "metadata.json", 0)]
)
def test_a_full_disk_names_the_file_on_every_rank(pools, tmp_path, where, file, failing_rank):
    messages = pools(2).run(_full_disk_on, where, str(tmp_path))
    staging = rf"{tmp_path}/run/step2\.tmp-[0-9a-f]{{32}}/{file}"
    tail = (
        r"No space left on device; free space on that filesystem or save to a directory on another one "
        r"\(the last committed checkpoint is untouched\)"
    )
    for rank, (kind, message) in enumerate(messages):
        prefix = "" if rank == failing_rank else rf"rank {failing_rank} failed: CheckpointWriteError: "
        assert kind == ("CheckpointWriteError" if rank == failing_rank else "RuntimeError"), (rank, kind)
        assert re.fullmatch(rf"{prefix}\[Errno 28\] could not write {staging}: {tail}", message), message


def _latest_on_full_disk(directory: str) -> list[str]:
    """Save step1, then step2 with the disk full on rank 0 only when it writes the `latest` pointer."""
    from shardtrain.checkpoint import commit

    run = Path(directory) / "run"
    model, optimizer, scheduler = build()
    st.save_checkpoint(run / "step1", state(model, optimizer, scheduler, step=1))
    if dist.get_rank() == 0:
        commit.open = _open_on_full_disk  # the commit module opens only the pointer's temporary file
    try:
        with pytest.raises((OSError, RuntimeError)) as info:
            st.save_checkpoint(run / "step2", state(model, optimizer, scheduler, step=2))
    finally:
        commit.__dict__.pop("open", None)
    dist.barrier()
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step1", "step2"]  # no .latest.<hex> left
    assert (run / "latest").read_text().strip() == "step1"
    assert st.load_checkpoint(run / "step2", state(*build(seed=1)))["step"] == 2
    return [type(info.value).__name__, str(info.value)]


def test_a_full_disk_at_the_latest_pointer_says_what_was_written(pools, tmp_path):
    (kind, message), (other_kind, other) = pools(2).run(_latest_on_full_disk, str(tmp_path))
    run = tmp_path / "run"
    assert kind == "CheckpointWriteError" and other_kind == "RuntimeError"
    assert message == (
        f"[Errno 28] the checkpoint {run}/step2 is complete, but the save could not point {run}/latest at "
        "it (it still names 'step1'): No space left on device; free space on that filesystem or save to a "
        f"directory on another one, then load {run}/step2 by its path or save again"
    )
    assert other == f"rank 0 failed: CheckpointWriteError: {message}"
