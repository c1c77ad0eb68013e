"""Plain-text tables for memory estimates: one itemised bill, or several strategies side by side.

Plain text rather than `rich` so the output reads the same in logs, pipes and tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .inputs import EstimateInputs
from .offload_time import DISK_READ_BYTES_PER_S, DISK_WRITE_BYTES_PER_S, disk_seconds, disk_time
from .sizes import format_count, format_gib


class MemoryEstimate(Protocol):
    """What a bill printed here reads of `estimate.MemoryEstimate` (this module does not import it,
    which imports this one to print itself)."""

    @property
    def inputs(self) -> EstimateInputs: ...
    @property
    def parameters(self) -> int: ...
    @property
    def gradients(self) -> int: ...
    @property
    def optimizer_state(self) -> int: ...
    @property
    def unsharded_params(self) -> int: ...
    @property
    def unsharded_grads(self) -> int: ...
    @property
    def reduce_buffers(self) -> int: ...
    @property
    def activations(self) -> int: ...
    @property
    def logits(self) -> int: ...
    @property
    def overhead(self) -> int: ...
    @property
    def total(self) -> int: ...
    @property
    def reserve(self) -> int: ...
    @property
    def host(self) -> int: ...
    @property
    def disk(self) -> int: ...
    @property
    def peak_phase(self) -> str: ...
    @property
    def phase_totals(self) -> Sequence[tuple[str, int]]: ...
    @property
    def notes(self) -> Sequence[str]: ...

    def fits(self, device_memory: int) -> bool: ...

    def largest_micro_batch(self, device_memory: int) -> int: ...


class StrategyComparison(Protocol):
    """What a side-by-side table reads of `compare.StrategyComparison`."""

    @property
    def estimates(self) -> Sequence[MemoryEstimate]: ...
    @property
    def device_memory(self) -> int | None: ...


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _dtype(dtype: torch.dtype | None) -> str:
    return _DTYPE_NAMES.get(dtype or torch.float32, str(dtype))


def checkpointing_label(every: int) -> str:
    """ "none", "every block" or "1 block in k" for activation checkpointing of 1 block in `every`."""
    return {0: "none", 1: "every block"}.get(every, f"1 block in {every}")


def describe_setup(inputs: EstimateInputs) -> str:
    """Two lines: the model, then everything about the step except the strategy."""
    model = inputs.model
    shape = f" ({model.shape.describe()})" if model.shape else ""
    mp = inputs.precision
    offload = ""
    if inputs.offload:
        moved = [
            w for w, on in (("params+grads", inputs.offload.params), ("optimizer", inputs.offload.optimizer)) if on
        ]
        share = (
            ""
            if inputs.offload.fraction == 1
            else f" (units holding >= {inputs.offload.fraction:.0%} of the parameters)"
        )
        offload = f", CPU offload of {' and '.join(moved)}{share}"
    return (
        f"{model.name}: {format_count(model.num_params)} parameters{shape}\n"
        f"{inputs.world_size} ranks, {_dtype(mp.param_dtype)} params / {_dtype(mp.reduce_dtype)} reduce, "
        f"{inputs.optimizer}, micro-batch {inputs.micro_batch} x seq {inputs.seq_len}, "
        f"activation checkpointing: {checkpointing_label(inputs.recompute_every)}{offload}"
    )


def _rows(estimate: MemoryEstimate) -> list[tuple[str, int]]:
    mp = estimate.inputs.precision
    p, r = _dtype(mp.param_dtype), _dtype(mp.reduce_dtype)
    frozen = " + frozen" if estimate.inputs.model.frozen_params else ""
    return [
        (f"parameters (fp32 master{frozen})", estimate.parameters),
        ("gradients (fp32)", estimate.gradients),
        (f"optimizer state ({estimate.inputs.optimizer})", estimate.optimizer_state),
        (f"unsharded params ({p})", estimate.unsharded_params),
        (f"unsharded grads ({p})", estimate.unsharded_grads),
        (f"reduce buffers ({r})", estimate.reduce_buffers),
        ("activations", estimate.activations),
        ("logits & loss", estimate.logits),
        ("overhead", estimate.overhead),
        ("total (peak allocated)", estimate.total),
        ("+ context & fragmentation", estimate.reserve),
        ("= device memory needed", estimate.total + estimate.reserve),
    ]


def _fit_line(estimate: MemoryEstimate, device_memory: int) -> str:
    verdict = "yes" if estimate.fits(device_memory) else "no"
    if estimate.inputs.model.shape is None:
        return f"fits in {format_gib(device_memory)} GiB: {verdict}"
    return (
        f"fits in {format_gib(device_memory)} GiB: {verdict}; "
        f"largest micro-batch: {estimate.largest_micro_batch(device_memory)}"
    )


def format_estimate(estimate: MemoryEstimate) -> str:
    inputs = estimate.inputs
    lines = [describe_setup(inputs), f"strategy {inputs.label}, shard group of {inputs.shard_size}"]
    rows = _rows(estimate)
    width = max(len(name) for name, _ in rows)
    lines.append(f"{'GiB per device at the peak':<{width}}")
    lines += [f"{name:<{width}}  {format_gib(value):>8}" for name, value in rows]
    if estimate.host:
        lines.append(f"{'host memory (offloaded)':<{width}}  {format_gib(estimate.host):>8}")
    if estimate.disk:
        lines.append(f"{'disk (offloaded state)':<{width}}  {format_gib(estimate.disk):>8}")
        lines.append(f"disk tier: {disk_time(disk_seconds(estimate.disk))}")
    phases = ", ".join(f"{name} {format_gib(total)}" for name, total in estimate.phase_totals)
    lines.append(f"peak during {estimate.peak_phase} ({phases})")
    if inputs.device_memory:
        lines.append(_fit_line(estimate, inputs.device_memory))
    lines += [f"note: {note}" for note in estimate.notes]
    return "\n".join(lines)


def format_comparison(comparison: StrategyComparison) -> str:
    estimates = comparison.estimates
    first = estimates[0]
    labels = [e.inputs.label for e in estimates]
    table = [[name for name, _ in _rows(first)]] + [[format_gib(v) for _, v in _rows(e)] for e in estimates]
    extra: list[list[str]] = [["peak during"] + [e.peak_phase for e in estimates]]
    if any(e.host for e in estimates):
        extra.append(["host memory (offloaded)"] + [format_gib(e.host) for e in estimates])
    if any(e.disk for e in estimates):
        extra.append(["disk (offloaded state)"] + [format_gib(e.disk) for e in estimates])
        rates = f"{DISK_READ_BYTES_PER_S / 1e9:.2f} / {DISK_WRITE_BYTES_PER_S / 1e9:.2f} GB/s"
        extra.append([f"disk tier, s per step ({rates})"] + [f"{disk_seconds(e.disk):.1f}" for e in estimates])
    memory = comparison.device_memory
    if memory:
        extra.append([f"fits in {format_gib(memory)} GiB"] + ["yes" if e.fits(memory) else "no" for e in estimates])
        if first.inputs.model.shape is not None:
            extra.append(["largest micro-batch"] + [str(e.largest_micro_batch(memory)) for e in estimates])
    rows = [list(row) for row in zip(*table)] + extra
    header = ["GiB per device at the peak"] + labels
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join([cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])])

    out = [describe_setup(first.inputs), line(header)] + [line(row) for row in rows]
    notes = dict.fromkeys(note for e in estimates for note in e.notes)
    out += [f"note: {note}" for note in notes]
    return "\n".join(out)
