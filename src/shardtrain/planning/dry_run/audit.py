"""Precision audit: the dtype of every tensor class of every unit, as `st.shard` will really make them.

Derived from the same objects `st.shard` uses (`resolve_options`'s `ShardOptions`, `Strategy`, the
unit partition), following what it does with them, and printed as a plain-text table (`str(audit)`)
so it reads the same in logs, pipes and tests. What each column means: docs/design.md, Note
[Precision audit].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...core.param_layout import layout_of_unit
from ...core.partition import partition
from ...options import resolve_options
from ...policy import MixedPrecision
from ...strategy import Strategy

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
_LOW = (torch.bfloat16, torch.float16)
_COLUMNS = ("stored", "compute", "grad", "reduce", "grad (opt)", "optim state", "buffers")


def dtype_name(dtype: torch.dtype | None) -> str:
    """'fp32', 'bf16', ... for floating dtypes, torch's name otherwise, '-' for None (no such tensor)."""
    if dtype is None:
        return "-"
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True, kw_only=True)
class UnitPrecision:
    """The dtypes of one unit's tensors; None where the unit has no such tensor (frozen, no buffers)."""

    name: str
    params: int
    stored: torch.dtype
    compute: torch.dtype
    grad: torch.dtype | None
    reduce: torch.dtype | None
    sharded_grad: torch.dtype | None
    optimizer_state: torch.dtype | None
    buffers: tuple[tuple[str, torch.dtype], ...]  # (name, dtype after placement) of the unit's own buffers

    @property
    def buffer_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(dict.fromkeys(dtype for _, dtype in self.buffers))

    def cells(self) -> tuple[str, ...]:
        buffers = "/".join(dtype_name(d) for d in self.buffer_dtypes) or "-"
        return (
            dtype_name(self.stored),
            dtype_name(self.compute),
            dtype_name(self.grad),
            dtype_name(self.reduce),
            dtype_name(self.sharded_grad),
            dtype_name(self.optimizer_state),
            buffers,
        )


@dataclass(frozen=True, kw_only=True)
class PrecisionAudit:
    """Per-unit dtypes plus where the state lives and which collectives run, for one `st.shard` setup."""

    model: str
    strategy: Strategy
    precision: MixedPrecision
    cpu_offload: bool
    units: tuple[UnitPrecision, ...]
    notes: tuple[str, ...]
    offloaded_units: tuple[str, ...] = ()  # names of the units CPU offload puts on the host
    unit_count: int = 0  # units of the partition (rows may be more: one per flat group)

    @property
    def communication(self) -> str:
        """The collectives of one step, in the dtypes they run in."""
        gather = dtype_name(self.units[0].compute) if self.units else "-"
        reduce = next((dtype_name(u.reduce) for u in self.units if u.reduce is not None), "-")
        s = self.strategy
        if s is Strategy.NO_SHARD:
            return f"all-reduce of gradients in {reduce}; no all-gather"
        trained = [u for u in self.units if u.reduce is not None]
        if trained and trained[0].compute.itemsize < trained[0].reduce.itemsize:  # type: ignore[union-attr]  # Groups.narrow_wire
            reduction = (
                f"gradients exchanged in {gather} (all-to-all) and summed in {reduce} on arrival "
                f"(a reduce-scatter in {reduce} when accumulated under no_sync)"
            )
        else:
            reduction = f"reduce-scatter of gradients in {reduce}"
        if s is Strategy.OPTIMIZER_ONLY:
            return f"{reduction}; all-gather ({gather}) of the updated shards after the step"
        gathers = "forward and again in backward" if s.reshard_after_forward else "forward only (kept through backward)"
        across = "; all-reduce of the shards across replica groups" if s.is_hybrid else ""
        return f"all-gather ({gather}) in {gathers}; {reduction}{across}"

    @property
    def placement(self) -> str:
        """Where the stored shard, its gradient and the optimizer state live."""
        total = self.unit_count or len(self.units)
        if self.offloaded_units and len(self.offloaded_units) < total:
            names = ", ".join(self.offloaded_units)
            return (
                f"host (CPU offload) for {len(self.offloaded_units)} of {total} units ({names}): "
                "stored shard, its gradient and the optimizer state; device: the other units' state, "
                "and unsharded copies"
            )
        if self.cpu_offload:
            return "host (CPU offload): stored shard, its gradient and the optimizer state; device: unsharded copies"
        if self.strategy.keeps_params_resident:
            return "device: stored shard, gradient, optimizer state, and the unsharded parameters for good"
        return "device: stored shard, gradient, optimizer state; unsharded parameters only while in use"

    def __str__(self) -> str:
        rows = [(u.name or "<root>", f"{u.params:,}", *u.cells()) for u in self.units]
        header = ("unit", "params", *_COLUMNS)
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

        def line(cells: tuple[str, ...]) -> str:
            return "  ".join(
                [cells[0].ljust(widths[0]), cells[1].rjust(widths[1])]
                + [c.ljust(w) for c, w in zip(cells[2:], widths[2:])]
            ).rstrip()

        out = [
            f"precision audit: {self.model}, {self.strategy.value}",
            f"communication: {self.communication}",
            f"placement: {self.placement}",
            line(header),
            "-" * len(line(header)),
        ]
        out += [line(r) for r in rows]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)


def _owner(path: str, unit_paths: set[str]) -> str:
    while path and path not in unit_paths:
        path = path.rpartition(".")[0]
    return path


def _buffers_by_unit(
    model: nn.Module, unit_paths: set[str], buffer_dtype: torch.dtype | None
) -> dict[str, list[tuple[str, torch.dtype]]]:
    out: dict[str, list[tuple[str, torch.dtype]]] = {path: [] for path in unit_paths}
    for path, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            dtype = buffer_dtype if buffer_dtype is not None and buf.is_floating_point() else buf.dtype
            out[_owner(path, unit_paths)].append((f"{path}.{name}" if path else name, dtype))
    return out


def _notes(units: tuple[UnitPrecision, ...], precision: MixedPrecision) -> list[str]:
    notes = []
    stored = {u.stored for u in units if u.grad is not None}
    computes = {u.compute for u in units}
    if stored & set(_LOW):
        notes.append(
            f"trainable parameters are stored in {'/'.join(dtype_name(d) for d in stored & set(_LOW))}: "
            "the optimizer updates low-precision weights with no fp32 master copy; pass "
            "mixed_precision='bf16' to keep fp32 masters and compute in bf16"
        )
    if torch.float16 in computes:
        notes.append(
            "fp16 gradients under- and overflow without loss scaling: step through st.GradScaler "
            "(the Engine refuses fp16; use bf16 there)"
        )
    if precision.reduce_dtype in _LOW:
        notes.append(
            f"gradients are summed across ranks in {dtype_name(precision.reduce_dtype)}: cheaper "
            "communication, but the sum loses precision as ranks grow; reduce_dtype=torch.float32 avoids it"
        )
    if precision.param_dtype is not None and precision.cast_forward_inputs:
        notes.append(f"floating inputs of each unit's forward are cast to {dtype_name(precision.param_dtype)}")
    kept = [u.name or "<root>" for u in units if any(d not in computes for d in u.buffer_dtypes)]
    if kept and precision.buffer_dtype is None and precision.param_dtype is not None:
        notes.append(
            f"buffers of {', '.join(kept)} stay as built (no buffer_dtype), not {dtype_name(precision.param_dtype)}"
        )
    return notes


def audit_precision(
    model: nn.Module,
    *,
    wrap: Any = None,
    strategy: Any = "full_shard",
    mixed_precision: Any = None,
    cpu_offload: Any = False,
) -> PrecisionAudit:
    """The dtype of parameters, gradients, reductions, optimizer state and buffers of each unit.

    Takes the arguments of `st.shard` (any device, the meta device included; no process group) and
    returns what st.shard would produce from them (see the module docstring). Raises ValueError for
    what st.shard refuses: an unknown strategy or precision.
    """
    options = resolve_options(strategy=strategy, mixed_precision=mixed_precision, cpu_offload=cpu_offload, wrap=wrap)
    strategy, precision, offload_policy = options.strategy, options.precision, options.offload
    parts = partition(model, wrap)
    on_host = offload_policy.select(spec.numel for spec in parts.units) if offload_policy else []
    buffers = _buffers_by_unit(model, {spec.name for spec in parts.units}, precision.buffer_dtype)
    units: list[UnitPrecision] = []
    offloaded: list[str] = []
    for spec, on in zip(parts.units, on_host or [False] * len(parts.units)):
        named: list[tuple[str, tuple[str, ...], torch.Tensor]] = [
            (occ[0].fqn, (), p) for p, occ in zip(spec.params, spec.occurrences)
        ]
        layout = layout_of_unit(named, world=1, precision=precision)
        groups = layout.groups or ()
        for k, group in enumerate(groups or [None]):
            members = [layout.params[i] for i in group.members] if group else []
            trains = bool(group and group.trainable)
            stored = group.dtype if group else torch.float32
            name = spec.name if len(groups) <= 1 else f"{spec.name or '<root>'} [{k + 1}/{len(groups)}]"
            units.append(
                UnitPrecision(
                    name=name,
                    params=sum(m.numel for m in members),
                    stored=stored,
                    compute=group.compute_dtype if group else stored,
                    grad=group.compute_dtype if group and trains else None,
                    reduce=(precision.reduce_dtype or stored) if trains else None,
                    sharded_grad=stored if trains else None,
                    optimizer_state=stored if trains else None,
                    buffers=tuple(buffers[spec.name]) if k == 0 else (),
                )
            )
        if on:
            offloaded.append(spec.name or "<root>")
    return PrecisionAudit(
        model=type(model).__name__,
        strategy=strategy,
        precision=precision,
        cpu_offload=offload_policy is not None,
        units=tuple(units),
        notes=tuple(_notes(tuple(units), precision)) + parts.notes,
        offloaded_units=tuple(offloaded),
        unit_count=len(parts.units),
    )
