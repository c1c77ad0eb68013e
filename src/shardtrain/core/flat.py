"""Flat-parameter layout: where each original parameter lives in a unit's padded flat buffer.

The layout is pure bookkeeping (no tensors), so the planner, the checkpoint code and the estimator
can reason about shards without a process group. Every rank owns the contiguous slice
`[rank * shard_numel, (rank + 1) * shard_numel)` of the padded flat buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class ParamSlot:
    """One original parameter inside a flat buffer.

    `fqn` is the canonical name (first occurrence in module order); `aliases` are the other names
    under which the same tensor is registered (tied weights).
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    requires_grad: bool
    aliases: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True, kw_only=True)
class LocalPiece:
    """The part of one parameter that lies in one rank's shard.

    `param_start` indexes the flattened parameter, `shard_start` the rank's shard; both span `numel`.
    """

    param_start: int
    shard_start: int
    numel: int


@dataclass(frozen=True, kw_only=True)
class FlatLayout:
    slots: tuple[ParamSlot, ...]
    shard_world: int

    @property
    def numel(self) -> int:
        return self.slots[-1].end if self.slots else 0

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.shard_world

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.shard_world)

    def shard_range(self, rank: int) -> tuple[int, int]:
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def local_piece(self, slot: ParamSlot, rank: int) -> LocalPiece:
        """Intersection of `slot` with `rank`'s shard (numel 0 when they do not overlap)."""
        lo, hi = self.shard_range(rank)
        start, end = max(lo, slot.offset), min(hi, slot.end)
        if end <= start:
            return LocalPiece(param_start=0, shard_start=0, numel=0)
        return LocalPiece(param_start=start - slot.offset, shard_start=start - lo, numel=end - start)

    @property
    def split_sizes(self) -> list[int]:
        """Sizes that `torch.split` of the padded flat buffer needs: each parameter, then padding."""
        sizes = [s.numel for s in self.slots]
        pad = self.padded_numel - self.numel
        return sizes + [pad] if pad else sizes


def build_layout(named: list[tuple[str, torch.Tensor, tuple[str, ...]]], shard_world: int) -> FlatLayout:
    """Lay out `(fqn, param, aliases)` back to back in the order given."""
    if shard_world < 1:
        raise ValueError(f"shard_world={shard_world} must be >= 1")
    slots, offset = [], 0
    for fqn, param, aliases in named:
        slot = ParamSlot(
            fqn=fqn,
            shape=tuple(param.shape),
            dtype=param.dtype,
            offset=offset,
            requires_grad=param.requires_grad,
            aliases=aliases,
        )
        slots.append(slot)
        offset = slot.end
    return FlatLayout(slots=tuple(slots), shard_world=shard_world)
