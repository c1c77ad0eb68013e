"""Step timers and peak-memory readings, for CUDA and for the CPU.

On CUDA a step is timed by events recorded on the current stream (the device's time, with no host
synchronisation inside the timed loop); peak allocated/reserved memory comes from the caching
allocator, reset after warm-up. On the CPU a step is wall time and memory is the process's peak
resident set size.
"""

from __future__ import annotations

import resource
import time

import torch

GIB = float(1 << 30)


class StepTimer:
    """`start()` / `stop()` around each step; `milliseconds()` after the last one."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list = []

    def start(self) -> None:
        self._marks.append([self._now(), None])

    def stop(self) -> None:
        self._marks[-1][1] = self._now()

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def milliseconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) for start, end in self._marks]
        return [(end - start) * 1000.0 for start, end in self._marks]


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> dict[str, float | None]:
    """Peak allocated and reserved device memory since the last reset, and peak host RSS, in GiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux reports KiB
    if device.type != "cuda":
        return {"allocated": None, "reserved": None, "rss": rss}
    return {
        "allocated": torch.cuda.max_memory_allocated(device) / GIB,
        "reserved": torch.cuda.max_memory_reserved(device) / GIB,
        "rss": rss,
    }
