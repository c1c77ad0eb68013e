"""A pool of worker processes that hold one Gloo process group for many test cases.

Starting processes and a process group costs seconds; a pool pays it once per world size and then
runs test functions on every rank. Fail-fast: when any rank raises or the deadline passes, the pool
is killed (so no rank stays blocked in a collective) and restarted for the next call, and the call
raises `RankFailure` carrying the failing rank's traceback.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


class RankFailure(AssertionError):
    """A rank raised, or the ranks did not finish before the deadline."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results, threads: int) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a Gloo pool computes on the CPU, also on GPU machines
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    faulthandler.enable()  # a rank that crashes (a signal) prints its stacks
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the pool asks for stacks when a call hangs
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class ProcessGroupPool:
    def __init__(self, world_size: int, *, threads_per_rank: int = 1) -> None:
        self.world_size = world_size
        self.threads = threads_per_rank
        # Forked from a server that has imported torch once (as DataLoader workers fork; importing these
        # modules queries no CUDA device): a rank starts in well under a second instead of each paying
        # the ~5 s torch import of a spawn; the rank still sets CUDA_VISIBLE_DEVICES before any CUDA use.
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo"])
        self._procs: list = []
        self._start()

    def _start(self) -> None:
        port = _free_port()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._results = self._ctx.Queue()
        self._procs = [
            self._ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self._tasks[r], self._results, self.threads),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []

    def _exits(self) -> str:
        """The exit codes of the ranks that died (a negative code: killed by that signal)."""
        dead = {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive()}
        return f"dead ranks and exit codes: {dead}" if dead else "no rank died"

    def _dump_stacks(self) -> None:
        """Every live rank prints its threads' Python stacks to stderr: where a hung call is stuck."""
        for p in self._procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(2)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 240.0, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the per-rank results in rank order."""
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        try:
            while len(out) < self.world_size:
                try:
                    rank, ok, value = self._results.get(timeout=timeout)
                except queue.Empty:
                    self._dump_stacks()
                    raise RankFailure(
                        f"{fn.__name__}: ranks {sorted(set(range(self.world_size)) - set(out))} "
                        f"did not finish within {timeout:.0f}s ({self._exits()})"
                    ) from None
                if not ok:
                    time.sleep(0.5)  # a peer that crashed and made this rank fail has exited by now
                    raise RankFailure(
                        f"{fn.__name__} failed on rank {rank} of {self.world_size} ({self._exits()}):\n{value}"
                    )
                out[rank] = value
        except BaseException:
            self._kill()
            self._start()
            raise
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Ask every rank to leave, then kill what has not: a pool holds nothing that must be flushed, and
        tearing down the groups the tests created can take seconds."""
        for q in self._tasks:
            q.put(None)
        deadline = time.monotonic() + 1
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()
