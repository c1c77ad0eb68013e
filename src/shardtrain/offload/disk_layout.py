"""How the disk tier lays out a unit's optimizer state in its region of the file, and how a state
tensor whose values are in the file looks to the user's optimizer (offload/disk_state.py streams them).

A region packs the unit's elementwise state tensors (shaped like the parameter's local rows), each on
a cache line, and is rounded up to `aio.ALIGN` for O_DIRECT. A tensor on disk keeps its shape and
dtype and has an empty storage (`on_disk`); `evict` and `restore` move it there and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..core.sharded_param import local_of
from .aio import align_up

if TYPE_CHECKING:
    from ..core.unit import ShardUnit

PIECE_ALIGN = 64  # each state tensor starts on a cache line inside its unit's region


@dataclass(frozen=True, kw_only=True)
class Piece:
    """One state tensor's place in its unit's region."""

    key: tuple[int, str]  # (id of the user's parameter, state key)
    start: int  # byte offset inside the region
    numel: int
    dtype: torch.dtype


@dataclass(frozen=True, kw_only=True)
class Region:
    """One unit's bytes in the file and the tensors they hold."""

    offset: int  # in the file, ALIGN-aligned
    nbytes: int  # ALIGN-aligned
    pieces: tuple[Piece, ...]

    def piece_view(self, slot: torch.Tensor, piece: Piece, shape: torch.Size) -> torch.Tensor:
        size = piece.numel * piece.dtype.itemsize
        return slot[piece.start : piece.start + size].view(piece.dtype).view(shape)


def layout(entries: list[tuple[tuple[int, str], torch.Tensor]]) -> tuple[tuple[Piece, ...], int]:
    """The pieces of a region holding `entries` ((key, tensor) in order) and its aligned size."""
    pieces, end = [], 0
    for key, tensor in entries:
        end = -(-end // PIECE_ALIGN) * PIECE_ALIGN
        pieces.append(Piece(key=key, start=end, numel=tensor.numel(), dtype=tensor.dtype))
        end += tensor.numel() * tensor.element_size()
    return tuple(pieces), align_up(end)


def on_disk(tensor: torch.Tensor) -> bool:
    """Whether a state tensor's values are in the files (its storage is empty)."""
    return tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0


def evict(tensor: torch.Tensor) -> None:
    """Give the tensor a storage of its own and empty it (the old one may be shared with the caller's
    state dict, which must keep its values)."""
    holder = torch.empty(tensor.shape, dtype=tensor.dtype)  # never touched: no pages are committed
    tensor.set_(holder.untyped_storage(), 0, holder.shape, holder.stride())
    tensor.untyped_storage().resize_(0)


def predicted_bytes(optimizer: torch.optim.Optimizer, unit: ShardUnit) -> int:
    """The region the unit's state will take once created: AdamW and Adam keep 2 tensors per parameter
    (3 with amsgrad), SGD 1 with momentum; others are not stepped per unit."""
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    end = 0
    for p in unit.params:
        group = groups.get(id(p))
        if group is None:
            continue
        if isinstance(optimizer, torch.optim.SGD):
            count = 1 if group.get("momentum", 0) else 0
        else:
            count = 3 if group.get("amsgrad") else 2
        for _ in range(count if local_of(p).numel() else 0):
            end = -(-end // PIECE_ALIGN) * PIECE_ALIGN + local_of(p).numel() * p.element_size()
    return align_up(end)


def elementwise(value: Any, param: torch.Tensor) -> bool:
    """Whether an optimizer state entry goes to the files: a tensor shaped like the parameter's rows."""
    if not isinstance(value, torch.Tensor):
        return False
    t = local_of(value)
    return t.numel() > 0 and t.shape == local_of(param).shape and t.is_contiguous()


def empty_like(param: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The user's state entry for `rows` of `param` whose values are in the files: the parameter's
    kind of tensor (a DTensor of the same placement for a sharded parameter) with an empty storage."""
    shell = torch.empty(rows.shape, dtype=rows.dtype)
    evict(shell)
    if not isinstance(param, DTensor):
        return shell
    # Note: DTensor's constructor with the parameter's spec (what zeros_like(param) gives); from_local()
    # would move the host rows of an offloaded unit to the mesh's device.
    spec = param._spec
    meta = TensorMeta(param.shape, param.stride(), rows.dtype)
    return DTensor(shell, DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta), requires_grad=False)


def aliases(unit: ShardUnit, view: Any, optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(the user's parameter, the view's alias of its rows) for the unit's parameters the view steps:
    the view holds, group by group, the unit's parameters with a gradient in the optimizer's order."""
    mine = {id(p) for p in unit.params}
    params = [p for g in optimizer.param_groups for p in g["params"] if id(p) in mine and p.grad is not None]
    aliases = [a for g in view.param_groups for a in g["params"]]
    assert len(params) == len(aliases), f"unit {unit.name}: {len(params)} parameters, {len(aliases)} in its step"
    return list(zip(params, aliases))


def restore(tensor: torch.Tensor, values: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
    tensor.copy_(values)
