"""The disk tier (core/disk_state.py, core/aio.py): optimizer state in per-rank files, bitwise the
host-memory offload; O_DIRECT and buffered I/O; crash safety; bounded memory; a full disk."""

import errno
import os
import tempfile

import pytest
import torch

import shardtrain as st
from shardtrain.core import aio
from tests.core.disk_state_ranks import disk_equals_memory


def _buffered_dir(tmp_path):
    """tmpfs where there is one (the buffered path's usual home), else the test's directory."""
    if os.path.isdir("/dev/shm"):
        d = tempfile.mkdtemp(prefix="shardtrain-test-", dir="/dev/shm")
        return d
    return str(tmp_path)


def test_disk_state_is_bitwise_host_memory(pools, tmp_path):
    shm = _buffered_dir(tmp_path)
    try:
        sizes = pools(2).run(disk_equals_memory, str(tmp_path), shm)
    finally:
        if shm != str(tmp_path):
            import shutil

            shutil.rmtree(shm, ignore_errors=True)
    assert all(s["direct"] > 0 for s in sizes)


def test_async_file_round_trip_both_modes(tmp_path, monkeypatch):
    """Reads and writes of several chunks in flight, O_DIRECT and buffered; the probe falls back on EINVAL."""
    monkeypatch.setattr(aio, "CHUNK", 3 * aio.ALIGN)
    data = torch.randint(0, 256, (10 * aio.ALIGN,), dtype=torch.uint8)
    for direct in (True, False):
        f = aio.AsyncFile(str(tmp_path / f"f-{direct}"), direct=direct, threads=3)
        buf = aio.aligned_empty(data.numel())
        buf.copy_(data)
        f.reserve(2 * data.numel())
        f.write(aio.ALIGN, buf).wait()
        back = aio.aligned_empty(data.numel())
        f.read(aio.ALIGN, back).wait()
        assert torch.equal(back, data)
        f.close()
    assert aio.direct_supported(str(tmp_path))
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    assert not aio.direct_supported(str(tmp_path))
    assert not list(tmp_path.glob(".shardtrain-direct-probe-*"))


def test_bad_options_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match=r"disk_dir='/no/such/dir'.*existing directory"):
        st.CPUOffload(disk_dir="/no/such/dir")
    with pytest.raises(ValueError, match=r"disk_buffer_bytes=0"):
        st.CPUOffload(disk_dir=str(tmp_path), disk_buffer_bytes=0)
    with pytest.raises(ValueError, match=r"without disk_dir"):
        st.CPUOffload(disk_buffer_bytes=1 << 20)
