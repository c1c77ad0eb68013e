"""What this rank holds of a sharded module: its piece of each parameter, its buffers, its duty.

With hybrid or no_shard strategies, replicas hold identical shards; only the replica whose
replicate-group rank is 0 writes them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..core.flat import LocalPiece, ParamSlot
from ..core.runtime import Runtime
from ..core.shard import runtime_of
from ..core.unit import ShardUnit


def held_piece(unit: ShardUnit, slot: ParamSlot) -> LocalPiece:
    """The part of `slot` in this rank's shard (the whole parameter when nothing is sharded)."""
    if unit.layout.shard_world == 1:
        return LocalPiece(param_start=0, shard_start=slot.offset, numel=slot.numel)
    return unit.layout.local_piece(slot, unit.groups.shard_rank)


def writes_shards(runtime: Runtime) -> bool:
    """Whether this rank writes its shard: it belongs to the first replica."""
    replicate = runtime.groups.replicate
    return replicate is None or dist.get_rank(replicate) == 0


def param_names(runtime: Runtime) -> set[str]:
    return {name for unit in runtime.units for slot in unit.layout.slots for name in (slot.fqn, *slot.aliases)}


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `module.state_dict()` holds, by name (rank-local values, as in torch)."""
    params = param_names(runtime_of(module))
    return {name: value for name, value in module.state_dict(keep_vars=True).items() if name not in params}
