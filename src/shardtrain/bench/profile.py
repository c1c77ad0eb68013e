"""`--profile`: a torch.profiler trace of a few steps, and the step time split into where it went.

From the device events of the trace, each step's window splits into compute, exposed communication,
exposed copies and idle time, which add up to the window, so they show what a faster engine must
remove; `gaps` lists the longest stretches with the compute stream idle, and two more numbers count
the NCCL kernels a step launches and the compute that ran beside one. What each category counts and
why the last two matter: docs/design.md, Note [Where a step's time went].
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .intervals import difference, total, union

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GAPS_LISTED = 5


@dataclass(frozen=True, kw_only=True)
class Gap:
    """A stretch with the compute stream idle: where (ms from the first device event), how long, and
    the other streams' work that overlapped it most (empty: the device waited for the host)."""

    at_ms: float
    ms: float
    during: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    """Milliseconds per step."""

    steps: int
    step_ms: float
    compute_ms: float
    exposed_comm_ms: float
    exposed_copy_ms: float
    idle_ms: float
    comm_ms: float  # all NCCL kernel time, hidden or not
    collectives: float = 0.0  # NCCL kernels launched per step
    beside_comm_ms: float = 0.0  # compute-stream time that overlapped an NCCL kernel
    gaps: tuple[Gap, ...] = ()  # the longest compute-stream gaps of the profiled window

    def to_dict(self) -> dict:
        return asdict(self)


def breakdown_from_events(events: list[dict], *, steps: int) -> Breakdown | None:
    """The breakdown of chrome-trace device events (`ts`/`dur` in µs); None if there are none."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES and e.get("dur", 0) > 0]
    if not device:
        return None
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device]
    comm_flags = ["nccl" in e.get("name", "").lower() for e in device]
    streams = [e.get("args", {}).get("stream") for e in device]
    busy_by_stream: dict = {}
    for span, is_comm, stream in zip(spans, comm_flags, streams):
        if not is_comm:
            busy_by_stream.setdefault(stream, []).append(span)
    compute_stream = max(busy_by_stream, key=lambda s: total(busy_by_stream[s]), default=None)
    compute = union(busy_by_stream.get(compute_stream, []))
    comm = union(s for s, c in zip(spans, comm_flags) if c)
    copies = union(s for s, c, st in zip(spans, comm_flags, streams) if not c and st != compute_stream)
    window_start = min(start for start, _ in spans)
    window = max(end for _, end in spans) - window_start
    exposed_comm = difference(comm, compute)
    exposed_copy = difference(copies, compute + comm)
    busy = total(compute + comm + copies)
    per_step = 1.0 / (1000.0 * steps)  # µs in the whole window -> ms per step
    return Breakdown(
        steps=steps,
        step_ms=window * per_step,
        compute_ms=total(compute) * per_step,
        exposed_comm_ms=total(exposed_comm) * per_step,
        exposed_copy_ms=total(exposed_copy) * per_step,
        idle_ms=(window - busy) * per_step,
        comm_ms=total(comm) * per_step,
        collectives=sum(comm_flags) / steps,
        beside_comm_ms=(total(compute) - total(difference(compute, comm))) * per_step,
        gaps=_longest_gaps(spans, device, compute, origin=window_start),
    )


def _longest_gaps(
    spans: list[tuple[float, float]], events: list[dict], compute: list[tuple[float, float]], *, origin: float
) -> tuple[Gap, ...]:
    """The GAPS_LISTED longest compute-stream gaps, in time order. Note: only other streams' work can
    overlap a gap of the compute stream, so every event that does is named."""
    idle = difference([(origin, max(end for _, end in spans))], compute)
    gaps = []
    for start, end in sorted(idle, key=lambda gap: gap[0] - gap[1])[:GAPS_LISTED]:
        overlap: dict[str, float] = {}
        for (a, b), event in zip(spans, events):
            if a < end and b > start:
                name = short_kernel_name(event.get("name", ""))
                overlap[name] = overlap.get(name, 0.0) + min(b, end) - max(a, start)
        during = tuple(sorted(overlap, key=lambda name: -overlap[name])[:2])
        gaps.append(Gap(at_ms=(start - origin) / 1000.0, ms=(end - start) / 1000.0, during=during))
    return tuple(sorted(gaps, key=lambda gap: gap.at_ms))


def short_kernel_name(name: str) -> str:
    """`void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>(...)` -> `CatArrayBatchedCopy`;
    NCCL kernels by their collective (`nccl AllGather`)."""
    if name.startswith("ncclDevKernel_"):
        return "nccl " + name.removeprefix("ncclDevKernel_").split("_")[0].split("(")[0]
    base = name.removeprefix("void ").replace("(anonymous namespace)::", "").split("<")[0].split("(")[0]
    return base.rsplit("::", 1)[-1].strip() or name[:40]


def profile_steps(step: Callable[[], None], *, steps: int, device: torch.device, trace_path: str) -> Breakdown | None:
    """Run `step` `steps` times under torch.profiler; return the breakdown, and keep the trace,
    gzipped, at `trace_path` when it is not empty."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            events = json.load(f).get("traceEvents", [])
        if trace_path:
            with open(raw, "rb") as src, gzip.open(trace_path, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return breakdown_from_events(events, steps=steps)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
