"""Asynchronous positional file I/O for the disk tier: several requests in flight, O_DIRECT where allowed.

A request (read or write one byte range to or from one host buffer) is cut into `CHUNK`-sized pieces,
each an `os.preadv` / `os.pwritev` on a thread of a small pool: those calls release the GIL, so the
pieces run in parallel in the kernel and keep the device's queue full (the throughput measured on one
disk, one thread against several: BENCHMARKS.md, 'Disk tier'; the standard library needs no build
step, and kvikio's host path does the same on threads). With
`O_DIRECT` the page cache is bypassed (no second copy of the state in host memory, no write-back
storm), which requires the buffer address, the file offset and the length to be multiples of `ALIGN`:
`aligned_empty` hands out such buffers and the disk tier lays out its regions on `ALIGN` boundaries.
File systems without O_DIRECT (older tmpfs, some network file systems: `open` fails with EINVAL) get
buffered I/O on the same code path; `direct_supported` probes a directory once.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

ALIGN = 4096  # the logical block size O_DIRECT needs on every device we run on (512 would do on some)
CHUNK = 8 << 20  # bytes per preadv/pwritev: large enough to stream, small enough to spread over threads


def align_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 host tensor of `align_up(nbytes)` bytes starting on an `ALIGN` boundary."""
    size = align_up(nbytes)
    raw = torch.empty(size + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + size]


def direct_supported(directory: str) -> bool:
    """Whether files in `directory` can be opened and written with O_DIRECT (a one-block probe)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    fd, path = tempfile.mkstemp(prefix=".shardtrain-direct-probe-", dir=directory)
    os.close(fd)
    try:
        direct = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        os.unlink(path)
    try:
        os.pwritev(direct, [aligned_empty(ALIGN).numpy().data], 0)
        return True
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        os.close(direct)


class Request:
    """One read or write in flight: done when all its pieces are; `wait()` re-raises the first error."""

    def __init__(self, pieces: int) -> None:
        self._left = pieces
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._callbacks: list[Callable[[Request], None]] = []
        self._lock = threading.Lock()
        self._finished = pieces == 0  # every piece done (callbacks run before `wait()` returns)
        if self._finished:
            self._done.set()

    def _piece_done(self, error: BaseException | None) -> None:
        with self._lock:
            self._error = self._error or error
            self._left -= 1
            self._finished = self._left == 0
            callbacks = list(self._callbacks) if self._finished else []
        if self._finished:
            for callback in callbacks:
                callback(self)
            self._done.set()

    def add_done_callback(self, callback: Callable[[Request], None]) -> None:
        """Call `callback(self)` once every piece is done (at once if they already are)."""
        with self._lock:
            if not self._finished:
                self._callbacks.append(callback)
                return
        callback(self)

    @property
    def error(self) -> BaseException | None:
        return self._error

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class AsyncFile:
    """A file read and written at byte offsets by `threads` threads; O_DIRECT when `direct`."""

    def __init__(self, path: str, *, direct: bool, threads: int) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
        self.path = path
        self.direct = direct
        self.fd = os.open(path, flags, 0o600)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardtrain-aio")

    def reserve(self, nbytes: int) -> None:
        """Allocate the file's blocks up front, so running out of space shows now (ENOSPC), not mid-step."""
        if nbytes > os.fstat(self.fd).st_size:
            os.posix_fallocate(self.fd, 0, nbytes)

    def read(self, offset: int, buffer: torch.Tensor) -> Request:
        """Fill the uint8 `buffer` from the file at `offset`."""
        return self._submit(offset, buffer, write=False)

    def write(self, offset: int, buffer: torch.Tensor) -> Request:
        """Write the uint8 `buffer` to the file at `offset`."""
        return self._submit(offset, buffer, write=True)

    def _submit(self, offset: int, buffer: torch.Tensor, *, write: bool) -> Request:
        if self.direct and (offset % ALIGN or buffer.numel() % ALIGN or buffer.data_ptr() % ALIGN):
            raise ValueError(
                f"O_DIRECT I/O on {self.path} needs offset, length and address aligned to {ALIGN} bytes; "
                f"got offset {offset}, length {buffer.numel()}, address {buffer.data_ptr():#x}"
            )
        view = buffer.numpy().data  # a memoryview of the tensor's bytes
        starts = range(0, len(view), CHUNK)
        request = Request(len(starts))
        for start in starts:
            piece = view[start : start + CHUNK]
            future = self._pool.submit(_transfer, self.fd, piece, offset + start, write)
            future.add_done_callback(lambda f: request._piece_done(f.exception()))
        return request

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        os.close(self.fd)


def _transfer(fd: int, piece: memoryview, offset: int, write: bool) -> None:
    """Move all of `piece` (short transfers continue where they stopped)."""
    done = 0
    while done < len(piece):
        call = os.pwritev if write else os.preadv
        n = call(fd, [piece[done:]], offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"{'write' if write else 'read'} of 0 bytes at offset {offset + done}")
        done += n
