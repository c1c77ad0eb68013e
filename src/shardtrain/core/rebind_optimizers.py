"""Optimizers built before `st.shard`: re-pointed at the sharded parameters at their first step.

`st.shard` replaces every parameter of the model by a sharded one. An optimizer built earlier holds
the old tensors and would update memory the model no longer reads, silently training nothing. Each
replaced tensor is remembered here (weakly); a global optimizer step pre-hook finds them in an
optimizer's parameter groups and, while the optimizer holds no state for them, swaps in the sharded
parameters (same groups, same hyperparameters), so the optimizer trains the model as written. An
optimizer that already stepped on the old tensors cannot be moved (its state has the old shapes)
and raises instead, naming the parameter.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

_replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()  # old parameter -> (weakref to its replacement, name)
_hook = None


def record(old: torch.Tensor, new: torch.Tensor, name: str) -> None:
    """`st.shard` replaced `old` (the model's parameter `name`) by `new`."""
    global _hook
    _replaced[old] = (weakref.ref(new), name)
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(lambda opt, args, kwargs: rebind(opt))


def rebind(optimizer: torch.optim.Optimizer) -> None:
    """Point `optimizer`'s parameter groups at the sharded parameters that replaced the ones they hold."""
    if not len(_replaced):
        return
    for group in optimizer.param_groups:
        params = group["params"]
        if not any(p in _replaced for p in params):
            continue
        rebound = []
        for p in params:
            entry = _replaced.get(p)
            if entry is None:
                rebound.append(p)
                continue
            new, name = entry[0](), entry[1]
            if new is None:
                raise ValueError(
                    f"the optimizer holds parameter {name!r} of a sharded model that no longer exists; "
                    "build the optimizer from the live model's parameters()"
                )
            if p in optimizer.state:
                raise ValueError(
                    f"the optimizer already stepped on parameter {name!r} as it was before st.shard; its state cannot "
                    "be moved onto the sharded parameter. Build the optimizer after st.shard, from model.parameters()"
                )
            rebound.append(new)
        group["params"] = rebound


def rebind_replaced(before: dict[str, nn.Parameter], model: nn.Module) -> None:
    """Something replaced the parameters before st.shard saw them (tensor parallelism, tp/engine_setup.py): an optimizer built on the
    originals (`before`, by name) is rebound from them."""
    for name, new in model.named_parameters():
        if name in before and before[name] is not new:
            record(before[name], new, name)
