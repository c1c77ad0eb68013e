"""The disk tier's per-rank state file: scratch that only the process which wrote it reads, with its
space checked and reserved before a region is first written (offload/disk_state.py lays regions in it).

Crash safety: the files are scratch. Each process creates its own file (exclusively, named by host,
pid and rank) and reads a region only after it wrote it itself, so nothing a killed process left
behind is ever read: a resume rebuilds the files from the checkpoint. Files of dead processes of this
host are removed when a new store opens the directory. Space is checked (`shutil.disk_usage`) and
reserved (`posix_fallocate`) before a region is first written; running out is one line naming the
directory and the bytes needed.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import socket
import weakref

import torch

from .aio import AsyncFile, Request, direct_supported


class DiskFullError(OSError):
    """The disk tier's directory lacks the space its state files need."""


class StateFile:
    """This process's state file under `directory`: O_DIRECT where the file system allows it, regions
    given out up to `end`, removed when the object is collected."""

    def __init__(self, *, directory: str, rank: int, threads: int) -> None:
        self.directory = directory
        _remove_stale(directory, rank)
        self.direct = direct_supported(directory)
        prefix = f"shardtrain-{socket.gethostname()}-pid{os.getpid()}-rank{rank}-"
        self.io = AsyncFile(
            os.path.join(directory, prefix + os.urandom(4).hex() + ".state"), direct=self.direct, threads=threads
        )
        weakref.finalize(self, _close, self.io)
        self.end = 0  # bytes of the file given to regions

    @property
    def path(self) -> str:
        return self.io.path

    def read(self, offset: int, buffer: torch.Tensor) -> Request:
        return self.io.read(offset, buffer)

    def write(self, offset: int, buffer: torch.Tensor) -> Request:
        return self.io.write(offset, buffer)

    def check_space(self, end: int) -> None:
        """Raise `DiskFullError` unless the directory has room to grow the file's regions to `end`."""
        need, free = end - self.end, shutil.disk_usage(self.directory).free
        if free < need:
            raise DiskFullError(errno.ENOSPC, self._full_message(need, free))

    def reserve(self, end: int) -> None:
        """Give the file's regions `end` bytes, their blocks allocated now (ENOSPC shows here, not mid-step)."""
        if end <= self.end:
            return
        self.check_space(end)
        need, free = end - self.end, shutil.disk_usage(self.directory).free
        try:
            self.io.reserve(end)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise DiskFullError(errno.ENOSPC, self._full_message(need, free)) from None
        self.end = end

    def wait(self, request: Request) -> None:
        """Wait for `request`; re-raise its failure (ENOSPC as one line)."""
        try:
            request.wait()
        except OSError as e:
            if e.errno == errno.ENOSPC:
                free = shutil.disk_usage(self.directory).free
                raise DiskFullError(errno.ENOSPC, self._full_message(self.end, free)) from None
            raise

    def _full_message(self, need: int, free: int) -> str:
        return (
            f"disk offload: {self.directory} has {free} bytes free, the optimizer state file needs {need} more "
            f"({self.end + need} in all for this rank): free space or point CPUOffload(disk_dir=...) elsewhere"
        )


def _close(file: AsyncFile) -> None:
    file.close()
    os.unlink(file.path)


def _remove_stale(directory: str, rank: int) -> None:
    """Remove state files that dead processes of this host left behind (never read, only in the way)."""
    for path in glob.glob(os.path.join(directory, f"shardtrain-{socket.gethostname()}-pid*-rank{rank}-*.state")):
        pid = int(os.path.basename(path).split("-pid")[1].split("-")[0])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os.unlink(path)
        except PermissionError:
            pass  # another user's live process
