"""`st.plan`: a dry run of the wrap policy, with no process group and no memory allocated.

Works on a model on any device, the meta device included. What trains is read from each parameter's
`requires_grad`: a frozen parameter keeps the dtype it was built in (no fp32 master) and holds no
gradient and no optimizer state, so the frozen units of a fine-tune (a peft model's base, say) show 0
in the gradient and optimizer columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...core.param_layout import layout_of_unit
from ...core.partition import partition
from ...options import resolve_options
from ...strategy import Strategy

MIB = 1024 * 1024
DOMINANT_FRACTION = 0.5
ADAMW_STATES = 2  # AdamW's moments, each like its (stored) parameter


@dataclass(frozen=True, kw_only=True)
class UnitRow:
    name: str
    params: int
    padded: int
    sharded_bytes: int  # per rank, the stored shards (fp32 masters of trainable parameters)
    grad_bytes: int  # per rank, the sharded gradients (trainable parameters only)
    unsharded_bytes: int  # the gathered parameters in their compute dtypes
    trainable: int = 0  # parameters that train (requires_grad)
    optimizer_bytes: int = 0  # per rank, AdamW's two moments of the trainable shards

    @property
    def frozen(self) -> bool:
        return self.trainable == 0


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: str
    world_size: int
    strategy: Strategy
    units: tuple[UnitRow, ...]
    warnings: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def total_params(self) -> int:
        return sum(u.params for u in self.units)

    def __str__(self) -> str:
        header = (
            f"{'unit':<32} {'params':>14} {'trainable':>14} {'MiB/rank sharded':>17} "
            f"{'grads+AdamW':>12} {'MiB unsharded':>14}"
        )
        lines = [
            f"shardtrain plan: {self.model}, {self.strategy.value}, world size {self.world_size}, "
            f"{len(self.units)} units",
            header,
            "-" * len(header),
        ]
        for u in self.units:
            lines.append(
                f"{(u.name or '<root>'):<32} {u.params:>14,} {u.trainable:>14,} {u.sharded_bytes / MIB:>17.2f} "
                f"{(u.grad_bytes + u.optimizer_bytes) / MIB:>12.2f} {u.unsharded_bytes / MIB:>14.2f}"
            )
        lines.append("-" * len(header))
        lines.append(
            f"{'total':<32} {self.total_params:>14,} {sum(u.trainable for u in self.units):>14,} "
            f"{sum(u.sharded_bytes for u in self.units) / MIB:>17.2f} "
            f"{sum(u.grad_bytes + u.optimizer_bytes for u in self.units) / MIB:>12.2f} "
            f"{sum(u.unsharded_bytes for u in self.units) / MIB:>14.2f}"
        )
        lines += [f"note: {n}" for n in self.notes] + [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def plan(
    model: nn.Module,
    *,
    wrap: Any = None,
    world_size: int = 1,
    strategy: Any = "full_shard",
    mixed_precision: Any = None,
) -> Plan:
    """Units, parameters and bytes per unit for `model` sharded over `world_size` ranks."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"plan: world_size={world_size!r} must be a positive int")
    options = resolve_options(strategy=strategy, mixed_precision=mixed_precision, wrap=wrap)
    strategy, precision = options.strategy, options.precision
    parts = partition(model, wrap)
    shard_world = 1 if strategy is Strategy.NO_SHARD else world_size
    looks_up = shard_world > 1 and not strategy.keeps_params_resident
    rows, notes = [], list(parts.notes)
    for spec in parts.units:
        named: list[tuple[str, tuple[str, ...], torch.Tensor]] = [
            (occ[0].fqn, (), p) for p, occ in zip(spec.params, spec.occurrences)
        ]
        layout = layout_of_unit(named, world=shard_world, precision=precision)
        gathers = not (looks_up and spec.can_look_up)
        if not gathers:
            notes.append(
                f"unit '{spec.name}' is an nn.Embedding: it looks its rows up on the shards and is never "
                "gathered (unless CPU-offloaded)"
            )
        rows.append(
            UnitRow(
                name=spec.name,
                params=layout.numel,
                padded=layout.padded_numel,
                sharded_bytes=layout.shard_bytes(),
                grad_bytes=layout.grad_bytes(),
                unsharded_bytes=layout.unsharded_bytes() if gathers else 0,
                trainable=layout.trainable_numel,
                optimizer_bytes=ADAMW_STATES * layout.grad_bytes(),
            )
        )
    total = sum(r.params for r in rows)
    frozen = sum(r.params - r.trainable for r in rows)
    if frozen:
        units = sum(r.frozen for r in rows)
        notes.append(
            f"{frozen:,} of {total:,} parameters are frozen ({units} of {len(rows)} units wholly): stored as "
            "built, with no gradient and no optimizer state"
        )
    warnings = []
    if total and len(rows) > 0:
        big = max(rows, key=lambda r: r.params)
        if big.params / total > DOMINANT_FRACTION and world_size > 1:
            warnings.append(
                f"unit '{big.name or '<root>'}' holds {100 * big.params / total:.0f}% of the parameters: its unsharded "
                "copy must fit on every rank at once, so sharding will save little; wrap smaller modules "
                "(e.g. the transformer block class) or use st.SizePolicy(min_params=...)"
            )
    return Plan(
        model=type(model).__name__,
        world_size=world_size,
        strategy=strategy,
        units=tuple(rows),
        warnings=tuple(warnings),
        notes=tuple(notes),
    )
