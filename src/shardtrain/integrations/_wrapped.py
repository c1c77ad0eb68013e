"""The forward wrapper the Lightning adapters hand to their framework, and finding the sharded root.

Lightning redirects `training_step` (and any method marked as a forward method) through the
strategy's wrapper's `forward`, so that DDP and FSDP see a forward. A sharded model gathers the
parameters its root unit holds (those outside every wrapped block: embeddings, final norm, head)
in the root's forward pre-hook; `ShardedModule` gives Lightning a wrapper whose forward calls the
root, so those parameters are gathered for `training_step` as they are for `forward`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.shard_module import RUNTIME_ATTR
from ..core.sharded_param import local_of


class ShardedModule(nn.Module):
    """Calls the sharded `module` (its hooks run, then its forward, or the method redirected there)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def sharded_root(module: nn.Module) -> nn.Module:
    """The module `st.shard` sharded, inside whatever wrappers (Fabric's, ours) hold it."""
    for candidate in module.modules():
        if hasattr(candidate, RUNTIME_ATTR):
            return candidate
    raise ValueError(f"{type(module).__name__} holds no model sharded by st.shard; set it up with the strategy first")


@torch.no_grad()
def clip_by_value(module: nn.Module, clip_val: float) -> None:
    """Clamp every gradient element to [-clip_val, clip_val] (on each rank's rows; elementwise, so exact)."""
    for param in module.parameters():
        if param.grad is not None:
            local_of(param.grad).clamp_(-clip_val, clip_val)
