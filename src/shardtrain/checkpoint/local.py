"""What this rank holds of a sharded module: its rows of each parameter, its buffers, its duty.

With hybrid or no_shard strategies, replicas hold identical shards; only the replica whose
replicate-group rank is 0 writes them. Under tensor parallelism a rank holds a box (rows x columns)
of each parameter's global tensor (tp/boxes.py), and only tp rank 0 writes the tp-replicated ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..core.partition import clean_name
from ..core.runtime import Runtime
from ..core.shard import runtime_of
from ..core.unit import ShardUnit


def held_range(unit: ShardUnit, index: int) -> tuple[int, int]:
    """(start, numel): the elements of parameter `index`, flattened, that this rank holds."""
    shard = unit.layout.params[index]
    if not shard.shape:
        return 0, 1
    start, stop = shard.held_rows(unit.comm.shard_rank if shard.world > 1 else 0)
    return start * shard.row_numel, (stop - start) * shard.row_numel


def writes_shards(runtime: Runtime) -> bool:
    """Whether this rank writes its shard: it belongs to the first replica."""
    replicate = runtime.comm.replicate
    return replicate is None or dist.get_rank(replicate) == 0


def param_names(runtime: Runtime) -> set[str]:
    return {name for unit in runtime.units for s in unit.layout.params for name in (s.fqn, *s.aliases)}


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `module.state_dict()` holds, by name (rank-local values, as in torch)."""
    params = param_names(runtime_of(module))
    named = ((clean_name(raw), value) for raw, value in module.state_dict(keep_vars=True).items())
    return {name: value for name, value in named if name not in params}
