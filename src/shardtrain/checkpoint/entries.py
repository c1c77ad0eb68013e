"""What the `state` dict of save_checkpoint/load_checkpoint holds, sorted by how each is stored.

- sharded modules (models passed through `st.shard`): each rank's rows of every parameter;
- sharded optimizers (all parameters belong to one sharded module of `state`): their state stored
  like the parameters it belongs to, so it reshards with them;
- objects (anything with state_dict/load_state_dict: schedulers, GradScaler, plain modules and
  optimizers): their state dicts, per rank, in a torch file;
- values (everything else): JSON metadata, returned by load_checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.held import HeldParam, held_params
from ..core.rebind_optimizers import rebind
from ..core.shard_module import RUNTIME_ATTR, runtime_of


@dataclass(frozen=True, kw_only=True)
class ShardedOptimizer:
    optimizer: torch.optim.Optimizer
    module: str  # the state key of the sharded module its parameters belong to
    refs: dict[int, HeldParam]  # id(param) -> where it lives

    def params(self) -> list[nn.Parameter]:
        """In `state_dict()` index order."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]


@dataclass(frozen=True, kw_only=True)
class Entries:
    modules: dict[str, nn.Module]
    optimizers: dict[str, ShardedOptimizer]
    objects: dict[str, Any]
    values: dict[str, Any]

    @property
    def comm_group(self):
        """The host-side (Gloo) group of the first sharded module, or None for the default group."""
        for module in self.modules.values():
            return runtime_of(module).control_group
        return None


def param_refs(module: nn.Module) -> dict[int, HeldParam]:
    return {id(h.param): h for h in held_params(module)}


def classify(state: dict[str, Any]) -> Entries:
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of name -> object or value, got {type(state).__name__}")
    for key in state:
        if not isinstance(key, str) or not key or "/" in key or key.startswith("."):
            raise ValueError(f"state key {key!r}: use a non-empty string without '/' (it names files)")
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module) and hasattr(v, RUNTIME_ATTR)}
    refs = {k: param_refs(m) for k, m in modules.items()}
    optimizers, objects, values = {}, {}, {}
    for key, value in state.items():
        if key in modules:
            continue
        if isinstance(value, torch.optim.Optimizer):
            rebind(value)  # built before st.shard: its groups now hold the sharded parameters
            owner = _owner(key, value, refs)
            if owner is not None:
                optimizers[key] = ShardedOptimizer(optimizer=value, module=owner, refs=refs[owner])
                continue
        if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            objects[key] = value
        else:
            values[key] = value
    return Entries(modules=modules, optimizers=optimizers, objects=objects, values=values)


def _owner(key: str, optimizer: torch.optim.Optimizer, refs: dict[str, dict[int, HeldParam]]) -> str | None:
    """The sharded module owning every parameter of `optimizer`; None when it owns none of them."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    owners = {next((m for m, r in refs.items() if id(p) in r), None) for p in params}
    if owners == {None} or not params:
        return None
    if None in owners or len(owners) > 1:
        found = sorted(o for o in owners if o is not None)
        also = " and parameters of no sharded module in state" if None in owners else ""
        raise ValueError(
            f"optimizer state[{key!r}] holds parameters of sharded modules {found}{also}; checkpoints "
            "need one optimizer per sharded model, with that model in state"
        )
    return owners.pop()
