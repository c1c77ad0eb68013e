"""The disk tier (offload/disk_state.py, offload/aio.py): optimizer state in per-rank files, bitwise the
host-memory offload; O_DIRECT and buffered I/O; crash safety; bounded memory; a full disk."""

import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import shardtrain as st
from shardtrain.offload import aio
from shardtrain.offload.disk_pool import BufferRing
from tests.offload.disk_state_ranks import (
    closure_step_equals_memory,
    crash,
    disk_equals_memory,
    full_disk,
    peak_rss,
    read_ahead_depth,
    resume_after_kill,
)


def _buffered_dir(tmp_path):
    """tmpfs where there is one (the buffered path's usual home), else the test's directory."""
    if os.path.isdir("/dev/shm"):
        return tempfile.mkdtemp(prefix="shardtrain-test-", dir="/dev/shm")
    return tempfile.mkdtemp(prefix="buffered-", dir=tmp_path)


def test_disk_state_is_bitwise_host_memory(pools, tmp_path):
    """O_DIRECT on a real disk (tmp_path), the default pool of 4 units."""
    assert all(size > 0 for size in pools(2).run(disk_equals_memory, str(tmp_path), "direct"))


def test_closure_step_reads_the_state_back(pools, tmp_path):
    assert pools(2).run(closure_step_equals_memory, str(tmp_path))[0] > 0


@pytest.mark.slow
def test_buffered_one_slot_is_bitwise_host_memory(pools, tmp_path):
    """Buffered I/O (tmpfs, the probe made to report no O_DIRECT) through a pool of one unit, over 5
    steps (the 10 with a resume run on O_DIRECT above; the I/O path is all that differs)."""
    buffered = _buffered_dir(tmp_path)
    try:
        assert all(size > 0 for size in pools(2).run(disk_equals_memory, buffered, "buffered", 5))
    finally:
        shutil.rmtree(buffered, ignore_errors=True)


def test_read_ahead_fills_the_pool_with_small_units(pools, tmp_path):
    """A pool sized for the largest unit holds 8 smaller ones: all their reads are in flight at once."""
    for depths in pools(2).run(read_ahead_depth, str(tmp_path)):
        assert depths == [(8, 8), (8, 8)], depths


def test_buffer_ring_lends_in_order_and_reuses_what_came_back():
    ring = BufferRing(10 * aio.ALIGN)
    a, b, c = (ring.take(3 * aio.ALIGN) for _ in range(3))
    assert ring.take(2 * aio.ALIGN) is None  # 1 block left at the end
    assert [v.data_ptr() - ring.buffer.data_ptr() for v in (a, b, c)] == [0, 3 * aio.ALIGN, 6 * aio.ALIGN]
    ring.give(b)  # out of order: reused only once `a` is back too
    assert ring.take(3 * aio.ALIGN) is None and ring.lent == 2
    ring.give(a)
    d = ring.take(5 * aio.ALIGN)  # wraps to the start, up to `c`
    assert d.data_ptr() == ring.buffer.data_ptr() and d.numel() == 5 * aio.ALIGN
    assert ring.take(aio.ALIGN + 1) is None  # [5, 6) blocks free: 1 block, less than 2 aligned ones
    e = ring.take(aio.ALIGN)
    assert e.data_ptr() - ring.buffer.data_ptr() == 5 * aio.ALIGN
    for view in (c, d, e):
        ring.give(view)
    assert ring.lent == 0 and ring.take(10 * aio.ALIGN) is not None
    with pytest.raises(ValueError, match="no view at byte"):
        ring.give(e)


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


@pytest.mark.slow
def test_peak_memory_is_the_pool_not_the_state(pools, tmp_path):
    """The state on disk is 4 times the pool; the resident set does not grow by more than 10% while
    the steps stream it (in host memory the state would add 4 pools)."""
    for r in pools(2).run(peak_rss, str(tmp_path), 1024, 32):
        assert r["on_disk"] >= 4 * r["pool"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("when", ["between_steps", "write"])
def test_killed_rank_resumes_to_the_uninterrupted_numbers(pools, tmp_path, when):
    """Rank 1 is SIGKILLed between two steps or half way through a state write; the resume from the
    last checkpoint reads nothing the killed job left, removes its files and equals the uninterrupted run."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=crash, args=(r, 2, port, str(tmp_path), when), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    try:
        while procs[1].is_alive():
            assert time.monotonic() < deadline, "rank 1 was never killed"
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=30)
    assert procs[1].exitcode == -signal.SIGKILL and (tmp_path / "killed").exists()
    left = pools(2).run(resume_after_kill, str(tmp_path))
    # rank 1 was SIGKILLed (its file stays until the resume removes it); rank 0 may have exited on the
    # broken connection first, removing its own file
    assert left[1] == 1 and left[0] in (0, 1), f"state files the killed job left, per rank: {left}"


def test_full_disk_is_one_line(pools, tmp_path):
    """Too little free space stops the first disk step with the directory and the bytes; so does
    ENOSPC from a write (a disk filled by someone else after the check)."""
    for message in pools(2).run(full_disk, str(tmp_path)):
        assert str(tmp_path) in message and "bytes free" in message and "\n" not in message, message


def test_cli_offload_dir(tmp_path):
    """`shardtrain train --engine.offload_dir DIR` asks the Engine for the disk tier; without CPU offload
    it is one line saying what to add."""
    from shardtrain.cli.train import engine_options
    from shardtrain.train.config import ConfigError, load_config

    cfg = load_config(None, ["--engine.cpu_offload", "true", "--engine.offload_dir", str(tmp_path)])
    assert engine_options(cfg)["cpu_offload"] == st.CPUOffload(disk_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"engine.offload_dir=.*--engine.cpu_offload true"):
        load_config(None, ["--engine.offload_dir", str(tmp_path)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_units_on_cuda(tmp_path):
    """The real path: `st.shard(cpu_offload=st.CPUOffload(disk_dir=...))` on a GPU, against host memory."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port=29646"]
    buffered = _buffered_dir(tmp_path)
    out = subprocess.run(
        [*command, str(root / "tests" / "offload" / "disk_state_gpu.py"), str(tmp_path), buffered],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    shutil.rmtree(buffered, ignore_errors=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "disk tier on CUDA: ok" in out.stdout
