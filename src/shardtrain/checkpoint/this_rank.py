"""What this rank holds of a sharded module: its rows of each parameter, its buffers, its duty.

With hybrid or no_shard strategies, replicas hold identical shards; only the replica whose
replicate-group rank is 0 writes them. Under tensor parallelism a rank holds a box (rows x columns)
of each parameter's global tensor (tp/boxes.py), and only tp rank 0 writes the tp-replicated ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..core.held import held_params
from ..core.partition import clean_name
from ..core.runtime import Runtime
from ..core.shard_module import runtime_of


def writes_shards(runtime: Runtime) -> bool:
    """Whether this rank writes its shard: it belongs to the first replica."""
    replicate = runtime.comm.replicate
    return replicate is None or dist.get_rank(replicate) == 0


def param_names(runtime: Runtime) -> set[str]:
    return {name for held in held_params(runtime) for name in held.names}


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `module.state_dict()` holds, by name (rank-local values, as in torch)."""
    params = param_names(runtime_of(module))
    named = ((clean_name(raw), value) for raw, value in module.state_dict(keep_vars=True).items())
    return {name: value for name, value in named if name not in params}
