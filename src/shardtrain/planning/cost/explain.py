"""Why the automatic plan chose what it chose: one human-readable line per decision.

Every line compares the choice with the configuration that differs in that one decision (less
checkpointing, another strategy, a larger micro-batch, no offload), and says what that one would need
or cost. The numbers come from the same candidates the choice was made from.
"""

from __future__ import annotations

from collections.abc import Sequence

from .candidates import Candidate
from .offload_time import disk_time
from .sizes import GiB, format_gib
from .speed import GATHER_EXPOSED_FRACTION, REFERENCE_TOKENS, StepTime

MiB = 1 << 20


def _gib(nbytes: int) -> str:
    """GiB with two decimals, or MiB below 1 GiB (differences between candidates can be that small)."""
    return f"{format_gib(nbytes)} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"


def _slower(time: StepTime, than: StepTime) -> str:
    return f"{100 * (time.total / than.total - 1):.1f}%"


def _compare(other: Candidate, best: Candidate) -> str:
    """How a configuration that also fits compares with the choice."""
    if other.time.total > best.time.total:
        return f"is predicted {_slower(other.time, best.time)} slower"
    if other.needed > best.needed:
        return f"is predicted as fast but needs {_gib(other.needed - best.needed)} more"
    return "is predicted the same in time and memory (the order of the strategies decided)"


def _same(a: Candidate, b: Candidate, *, but: str) -> bool:
    keys = {"strategy", "recompute_every", "cpu_offload", "disk_dir", "micro_batch"} - {but}
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def _checkpointing(best: Candidate, candidates: list[Candidate]) -> str:
    if best.checkpointed_blocks == 0:
        return (
            f"activation checkpointing: none, nothing is recomputed (the activations of micro-batch "
            f"{best.micro_batch} fit)"
        )
    fewer = [
        c
        for c in candidates
        if _same(c, best, but="recompute_every") and c.checkpointed_blocks < best.checkpointed_blocks
    ]
    extra = best.time.recompute / best.time.compute
    line = (
        f"activation checkpointing: {best.checkpointing.removesuffix(' checkpointed')}, +{extra:.1%} compute "
        "to recompute them"
    )
    if fewer:
        nearest = max(fewer, key=lambda c: c.checkpointed_blocks)
        line += f"; with less ({nearest.checkpointing}) this setup needs {_gib(nearest.needed)}"
    return line


def _strategies(best: Candidate, candidates: list[Candidate], usable: int) -> str:
    parts = []
    for other in candidates:
        if other.strategy is best.strategy or not _same(other, best, but="strategy"):
            continue
        label = other.estimate.inputs.label
        if other.needed > usable:
            parts.append(f"{label} needs {_gib(other.needed)}")
        else:
            parts.append(f"{label} {_compare(other, best)}")
    if not parts:
        return f"strategy: {best.estimate.inputs.label}, the only one weighed"
    return f"strategy: {best.estimate.inputs.label}; at the same checkpointing and batch split, " + "; ".join(parts)


def _batch(best: Candidate, candidates: list[Candidate], global_tokens: int, fixed: bool) -> str:
    split = f"micro-batch {best.micro_batch} x {best.grad_accum}"
    if fixed:
        return f"batch: {split}, as given (not split further)"
    line = f"batch: {split} keeps the global batch of {global_tokens:,} tokens"
    if best.grad_accum == 1:
        return line + "; one micro-batch per step is the most efficient split (no accumulation)"
    larger = [c for c in candidates if _same(c, best, but="micro_batch") and c.micro_batch > best.micro_batch]
    if larger:
        nearest = min(larger, key=lambda c: c.micro_batch)
        line += f"; micro-batch {nearest.micro_batch} would need {_gib(nearest.needed)}"
    dtype = "fp32" if best.estimate.inputs.reduce_bytes == 4 else f"{best.estimate.inputs.reduce_bytes}-byte"
    return line + (
        f"; no_sync holds {_gib(best.accumulation_bytes)} of unsharded {dtype} gradients between micro-batches"
    )


def _disk(best: Candidate, host_rejected: list[Candidate], usable: int, host_usable: int | None) -> str:
    """Why the disk tier: the configurations that fit the device needed more host memory than there is."""
    on_device = [c for c in host_rejected if c.needed <= usable and c.disk_dir is None]
    why = "nothing fits with device and host memory"
    if on_device and host_usable is not None:
        least = min(on_device, key=lambda c: c.host_bytes)
        why += (
            f" (the least host memory a configuration fitting the device needs, {least.describe()}, is "
            f"{_gib(least.host_bytes)} per process, {_gib(host_usable)} usable)"
        )
    return (
        f"disk tier: all units offloaded, their optimizer state in files under {best.disk_dir}: chosen because "
        f"{why}; {_gib(best.estimate.disk)} per process on disk, {_gib(best.host_bytes)} in host memory with "
        f"the disk buffers; {disk_time(best.time.disk_s)}"
    )


def _offload(best: Candidate, candidates: list[Candidate]) -> str:
    if not best.cpu_offload:
        return "CPU offload: not needed (weighed only when nothing fits on the device)"
    on_device = [c for c in candidates if not c.cpu_offload]
    smallest = min(on_device, key=lambda c: c.needed)
    share = "all units" if best.cpu_offload == 1 else f"the units holding {best.cpu_offload:.0%} of the parameters"
    return (
        f"CPU offload of {share}: chosen because nothing fits on the device without it (the smallest "
        f"on-device configuration, {smallest.describe()}, needs {_gib(smallest.needed)}); it keeps "
        f"{_gib(best.estimate.host)} per process in host memory, and the host step and copies add "
        f"{best.time.offload / best.time.tokens:.2f} x the ideal step time "
        f"({best.time.offload * best.time.token_s:.2f} s, planning/cost/offload_time.py)"
    )


def _baseline(best: Candidate, baseline: StepTime | None) -> list[str]:
    if baseline is None or baseline.total == best.time.total:
        return []
    return [
        f"vs full_shard with every block checkpointed at the same batch split: predicted "
        f"{baseline.total / best.time.total:.2f}x the tokens/s"
    ]


def explain(
    *,
    best: Candidate,
    candidates: list[Candidate],
    memory: int,
    usable: int,
    safety_margin: float,
    global_tokens: int,
    fixed_batch: bool,
    baseline: StepTime | None,
    host_rejected: Sequence[Candidate] = (),
    host_usable: int | None = None,
) -> tuple[str, ...]:
    """The reasons for `best` among `candidates` (everything weighed), as lines for a person;
    `host_rejected` are the offloaded configurations whose host share exceeds `host_usable`."""
    fits = [c for c in candidates if c.needed <= usable]
    lines = [
        f"fits: predicted {_gib(best.needed)} per device of {_gib(memory)} "
        f"({_gib(usable)} usable with the {safety_margin:.0%} safety margin)",
        f"fastest of the {len(fits)} configurations predicted to fit, of {len(candidates)} weighed; "
        f"step time {best.time.describe()}",
    ]
    faster = [
        c
        for c in candidates
        if c.time.total < best.time.total and (c.cpu_offload, c.disk_dir) == (best.cpu_offload, best.disk_dir)
    ]
    if faster:
        top = min(faster, key=lambda c: c.time.total)
        lines.append(
            f"faster but predicted not to fit: {top.describe()} ({_slower(best.time, top.time)} faster) "
            f"needs {_gib(top.needed)}"
        )
    rivals = [c for c in fits if c is not best]
    if rivals:
        runner = min(rivals, key=lambda c: (c.time.total, c.needed))
        lines.append(f"runner-up: {runner.describe()} {_compare(runner, best)}")
    lines += [
        _checkpointing(best, candidates),
        _strategies(best, candidates, usable),
        _batch(best, candidates, global_tokens, fixed_batch),
        _offload(best, candidates),
        *([_disk(best, list(host_rejected), usable, host_usable)] if best.disk_dir is not None else []),
        *_baseline(best, baseline),
        f"cost model (planning/cost/speed.py): compute ~ tokens x FLOPs per token / efficiency t/(t+256) per "
        f"micro-batch, recomputation = each checkpointed block's forward, full_shard's second all-gather "
        f"{GATHER_EXPOSED_FRACTION:.0%} of the compute of {REFERENCE_TOKENS:,} tokens per micro-batch",
    ]
    lines += [f"note: {n}" for n in best.estimate.notes]
    return tuple(lines)
