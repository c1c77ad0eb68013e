"""shardtrain: fully sharded data-parallel training for PyTorch.

Public names are imported lazily so that `import shardtrain` stays cheap and each layer loads only
when used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "shard": "shardtrain.sharding",
    "shard_auto": "shardtrain.planning.cost.shard_auto",
    "Strategy": "shardtrain.strategy",
    "SizePolicy": "shardtrain.policy",
    "MixedPrecision": "shardtrain.policy",
    "CPUOffload": "shardtrain.policy",
    "AutoPolicy": "shardtrain.policy",
    "clip_grad_norm_": "shardtrain.ops.grad_norm",
    "no_sync": "shardtrain.ops.no_sync",
    "full_state_dict": "shardtrain.ops.state_dict",
    "load_full_state_dict": "shardtrain.ops.state_dict",
    "plan": "shardtrain.planning.dry_run.units",
    "Plan": "shardtrain.planning.dry_run.units",
    "estimate_memory": "shardtrain.planning.cost.estimate",
    "MemoryEstimate": "shardtrain.planning.cost.estimate",
    "save_checkpoint": "shardtrain.checkpoint",
    "load_checkpoint": "shardtrain.checkpoint",
    "load_pretrained": "shardtrain.pretrained",
    "save_pretrained": "shardtrain.pretrained",
    "quantize_base": "shardtrain.pretrained",
    "Engine": "shardtrain.engine",
    "GradScaler": "shardtrain.ops.grad_scaler",
    "compile_blocks": "shardtrain.ops.compile",
    "chunked_cross_entropy": "shardtrain.models.chunked_ce",
}

# fine-tuning data (st.data.prepare, ...): needs the hf extra only when used; tensor-parallel plans (st.tp)
_MODULES = {"data": "shardtrain.data", "tp": "shardtrain.tp"}

__all__ = sorted([*_EXPORTS, *_MODULES])


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
