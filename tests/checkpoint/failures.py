"""Rank-side code of the save-failure tests: one step of a save fails on some ranks
(tests/checkpoint/test_save_errors.py).

Each failure is injected on the failing ranks only, at one step of the save: a full disk while
writing a module's tensors or an optimizer's, this rank's optimizer rows failing to assemble in the
middle of the full format's gathers, an I/O error in the commit. Every rank must raise, and the
last checkpoint with its `latest` pointer must be as it was, with no staging directory left.
"""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import pytest
import torch.distributed as dist

import shardtrain as st
from shardtrain.checkpoint import commit, tensorfile
from shardtrain.checkpoint.optim_state import OptimizerSnapshot
from tests.checkpoint.shapes import build, step
from tests.checkpoint.train_save_ranks import assert_same

# A tensor each step of the save writes, by format: the prefix of its name.
_TENSORS = {
    ("sharded", "module"): "param.blocks.",
    ("sharded", "optimizer"): "optim.optimizer.",
    ("full", "module"): "blocks.",
    ("full", "optimizer"): "state.blocks.",
}


@contextlib.contextmanager
def _patched(owner, name: str, replacement):
    original = owner.__dict__[name]
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _full_disk_writing(prefix: str):
    original = tensorfile.SafetensorsWriter.write

    def write(self, name, tensor):
        if name.startswith(prefix):
            with tensorfile.writing(self.path):
                raise OSError(errno.ENOSPC, "No space left on device")
        original(self, name, tensor)

    return _patched(tensorfile.SafetensorsWriter, "write", write)


def _rows_failing():
    def piece(self, fqn, key):
        raise RuntimeError(f"injected: the rows of {key} of {fqn} cannot be assembled")

    return _patched(OptimizerSnapshot, "piece", piece)


def _commit_failing():
    def fsync_dir(path):
        raise OSError(errno.EIO, "Input/output error")

    return _patched(commit, "_fsync_dir", fsync_dir)


def injected(fmt: str, where: str):
    if where == "rows":
        return _rows_failing()
    if where == "commit":
        return _commit_failing()
    return _full_disk_writing(_TENSORS[fmt, where])


def fail_in(directory: str, fmt: str, where: str, failing: list[int]) -> tuple[str, str]:
    """Save step1, then step2 with `where` failing on the ranks `failing`; return this rank's error
    (type name, message) after checking that step1 and `latest` are intact and nothing else is left."""
    run = Path(directory) / "run"
    model, optimizer = build(seed=0)
    step(model, optimizer)
    st.save_checkpoint(run / "step1", {"model": model, "optimizer": optimizer, "step": 1}, format=fmt)
    expected = st.full_state_dict(model, rank0_only=False)
    step(model, optimizer)
    failure = injected(fmt, where) if dist.get_rank() in failing else contextlib.nullcontext()
    with failure, pytest.raises(Exception) as info:
        st.save_checkpoint(run / "step2", {"model": model, "optimizer": optimizer, "step": 2}, format=fmt)
    dist.barrier()
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step1"]
    assert (run / "latest").read_text().strip() == "step1"
    fresh, fresh_optimizer = build(seed=1)
    assert st.load_checkpoint(run, {"model": fresh, "optimizer": fresh_optimizer}) == {"step": 1}
    assert_same(st.full_state_dict(fresh, rank0_only=False), expected, "step1 after the failed save")
    st.save_checkpoint(run / "step2", {"model": model, "optimizer": optimizer, "step": 2}, format=fmt)
    assert (run / "latest").read_text().strip() == "step2"  # the next save commits
    return type(info.value).__name__, str(info.value)
