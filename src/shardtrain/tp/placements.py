"""Where a tensor-parallel parameter's shard lives on the whole mesh: FSDP2's placements.

The engine cuts each rank's TP-local tensor along dim 0 over the data-parallel dimension, so the
tensor the optimizer sees is placed on the whole mesh as torch FSDP2 places it (`_StridedShard` where
the dp cut falls inside each tp block), and `full_tensor()` and `torch.distributed.checkpoint` put
every row back where it belongs. The table of placements: docs/design.md, Note [Tensor parallelism
inside units].
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard


def mesh_placements(tp: Placement, *, tp_size: int, hybrid: bool, cut: bool) -> tuple[Placement, ...]:
    """The placements on the whole mesh of a parameter placed `tp` on the "tp" dimension, whose
    TP-local tensor is cut along dim 0 over the shard dimension (`cut`; False for 0-dim parameters)."""
    if not isinstance(tp, (Shard, Replicate)) or isinstance(tp, _StridedShard):
        raise ValueError(f"a tensor-parallel parameter placed {tp} on 'tp': use Shard(dim) or Replicate()")
    if not cut:
        dp: Placement = Replicate()
    elif isinstance(tp, Shard) and tp.dim == 0 and tp_size > 1:
        dp = _StridedShard(0, split_factor=tp_size)
    else:
        dp = Shard(0)
    return ((Replicate(),) if hybrid else ()) + (dp, tp)


def replicated_on_tp(tp: Placement) -> bool:
    """Whether every tp rank holds the same values (each element counts once in a norm)."""
    return isinstance(tp, Replicate)
