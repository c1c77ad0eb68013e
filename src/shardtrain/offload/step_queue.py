"""The host step's worker thread: of the unit steps queued, it always runs the one needed first.

Unit steps are queued as their gradients become final (during backward, offload/backward_step.py) or
at `step()` (offload/host_step.py); the next forward needs them in forward order. A first-in first-out
queue would run the units backward finished first, which the forward needs last, so the queue is a
heap keyed by the unit's place in the next forward.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class StepQueue:
    """One worker thread running queued callables by priority (the lowest first, then by arrival)."""

    def __init__(self, *, device: torch.device) -> None:
        """The worker steps with `worker_threads()` intra-op threads on `device`."""
        self._heap: list[tuple[int, int, Callable[[], None], Future]] = []
        self._arrival = itertools.count()
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="shardtrain-host-step",
            initializer=_init_worker,
            initargs=(worker_threads(), device),
        )
        weakref.finalize(self, self._worker.shutdown, wait=True)

    def submit(self, priority: int, run: Callable[[], None]) -> Future:
        """Queue `run`; its future completes (or holds its error) once the worker ran it."""
        future: Future = Future()
        with self._lock:
            heapq.heappush(self._heap, (priority, next(self._arrival), run, future))
        # Note: one pop per submission, so every queued callable runs exactly once, the most urgent first.
        self._worker.submit(self._run_most_urgent)
        return future

    def _run_most_urgent(self) -> None:
        with self._lock:
            *_, run, future = heapq.heappop(self._heap)
        try:
            run()
        except BaseException as error:
            future.set_exception(error)
        else:
            future.set_result(None)


def worker_threads() -> int:
    """The worker's intra-op threads: one fewer than this process's (which `st.shard` set to
    CPUOffload.host_threads(), the one thread setting), so the main thread keeps a core to launch the
    GPU's work and copies beside the step (the gain measured: BENCHMARKS.md, 'Offloaded optimizer
    step')."""
    return max(1, torch.get_num_threads() - 1)


def _init_worker(threads: int, device: torch.device) -> None:
    """Note: intra-op threads and the current CUDA device are per thread; the worker takes the thread
    count derived from the host's and this rank's device (the
    optimizer's capture check queries the current device's stream, which would otherwise open a
    context on GPU 0 from every rank)."""
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
