"""Where every parameter of a unit lives: sharded along its first dimension, grouped into flat buffers.

Each parameter is cut along dim 0 into `world` equal padded blocks (a 0-dim one is held whole), and a
unit's parameters are grouped into `FlatGroup`s, each laid out three ways: the shard, the unsharded
buffer and the sharded gradient (`shard_offsets`, `unsharded_offsets`, `grad_offsets`), matching the
flat all-gather's and reduce-scatter's chunks. Pure bookkeeping (no tensors allocated), so the planner,
the estimator and the checkpoint code reason about shards without a process group. The layout and
why: docs/design.md, "Parameters keep their shape" and "Buffers and communication of one flat group".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch

from ..policy import MixedPrecision, storage_dtypes


@dataclass(frozen=True, kw_only=True)
class ParamShard:
    """One original parameter and how it is cut across `world` ranks.

    `dtype` is the stored (master) dtype the optimizer updates, `compute_dtype` the dtype forward
    and backward use; `fqn` is the canonical name, `aliases` the other names of a tied parameter.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    compute_dtype: torch.dtype
    requires_grad: bool
    world: int
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"{self.fqn}: world={self.world} must be >= 1")
        if not self.shape and self.world != 1:
            raise ValueError(f"{self.fqn}: a 0-dim parameter is never cut; give it world=1")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def local_rows(self) -> int:
        """Rows each rank stores (the last ranks' blocks end in padding rows)."""
        return -(-self.rows // self.world)

    @property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel

    @property
    def padded_rows(self) -> int:
        return self.local_rows * self.world

    @property
    def padded_numel(self) -> int:
        return self.padded_rows * self.row_numel

    def held_rows(self, rank: int) -> tuple[int, int]:
        """The real (not padding) rows `[start, stop)` of the parameter that `rank` holds."""
        start = min(rank * self.local_rows, self.rows)
        return start, min(start + self.local_rows, self.rows)

    def held_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of `rank`'s real rows (the whole shape for a 0-dim parameter)."""
        if not self.shape:
            return ()
        start, stop = self.held_rows(rank)
        return (stop - start, *self.shape[1:])


@dataclass(frozen=True, kw_only=True)
class FlatGroup:
    """Parameters of one unit that share one shard buffer and one unsharded buffer (module docstring)."""

    dtype: torch.dtype
    compute_dtype: torch.dtype
    sharded: bool  # False: every rank holds each member whole (0-dim parameters)
    members: tuple[int, ...]  # indices into `UnitLayout.params`, in unit order
    shard_offsets: tuple[int, ...]
    unsharded_offsets: tuple[int, ...]
    trainable: tuple[int, ...]  # the members (indices into `UnitLayout.params`) that require gradients
    grad_offsets: tuple[int, ...]  # of each trainable member in the sharded gradient
    shard_numel: int
    unsharded_numel: int
    grad_numel: int


@dataclass(frozen=True, kw_only=True)
class UnitLayout:
    params: tuple[ParamShard, ...]
    groups: tuple[FlatGroup, ...]
    world: int  # the shard group's size

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def padded_numel(self) -> int:
        return sum(p.padded_numel for p in self.params)

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel for p in self.params if p.requires_grad)

    def group_of(self, index: int) -> tuple[FlatGroup, int]:
        """The group holding parameter `index` and its position among the group's members."""
        for group in self.groups:
            if index in group.members:
                return group, group.members.index(index)
        raise KeyError(index)

    def shard_bytes(self) -> int:
        """Bytes of one rank's shards (the stored parameters)."""
        return sum(g.shard_numel * g.dtype.itemsize for g in self.groups)

    def unsharded_bytes(self) -> int:
        """Bytes of the gathered parameters in their compute dtypes."""
        return sum(g.unsharded_numel * g.compute_dtype.itemsize for g in self.groups)

    def grad_bytes(self) -> int:
        """Bytes of one rank's sharded gradients (trainable parameters only)."""
        return sum(g.grad_numel * g.dtype.itemsize for g in self.groups)


def build_unit_layout(params: list[ParamShard]) -> UnitLayout:
    """Group `params` (all cut for the same world size) into flat buffers, in first-appearance order."""
    worlds = {p.world for p in params if p.shape}
    if len(worlds) > 1:
        raise ValueError(f"the parameters of one unit are cut for several world sizes {sorted(worlds)}")
    keys: dict[tuple[torch.dtype, torch.dtype, bool], list[int]] = {}
    for i, p in enumerate(params):
        keys.setdefault((p.dtype, p.compute_dtype, bool(p.shape)), []).append(i)
    groups = []
    for (dtype, compute_dtype, sharded), members in keys.items():
        local = [params[i].local_numel for i in members]
        whole = [params[i].padded_numel for i in members]
        trainable = tuple(i for i in members if params[i].requires_grad)
        grads = [params[i].local_numel for i in trainable]
        groups.append(
            FlatGroup(
                dtype=dtype,
                compute_dtype=compute_dtype,
                sharded=sharded,
                members=tuple(members),
                shard_offsets=_starts(local),
                unsharded_offsets=_starts(whole),
                trainable=trainable,
                grad_offsets=_starts(grads),
                shard_numel=sum(local),
                unsharded_numel=sum(whole),
                grad_numel=sum(grads),
            )
        )
    return UnitLayout(params=tuple(params), groups=tuple(groups), world=worlds.pop() if worlds else 1)


def _starts(sizes: list[int]) -> tuple[int, ...]:
    return tuple(accumulate(sizes[:-1], initial=0)) if sizes else ()


def layout_of_unit(
    named: list[tuple[str, tuple[str, ...], torch.Tensor]], *, world: int, precision: MixedPrecision
) -> UnitLayout:
    """The layout of a unit holding `(name, aliases, tensor)` (meta tensors do) sharded over `world` ranks."""
    params = []
    for fqn, aliases, tensor in named:
        stored, compute = storage_dtypes(tensor.dtype, requires_grad=tensor.requires_grad, precision=precision)
        params.append(
            ParamShard(
                fqn=fqn,
                aliases=aliases,
                shape=tuple(tensor.shape),
                dtype=stored,
                compute_dtype=compute,
                requires_grad=tensor.requires_grad,
                world=world if tensor.dim() else 1,
            )
        )
    return build_unit_layout(params)
