"""Compile a sharded model's repeated blocks, the way torch.compile pays on a sharded model.

Each block's forward compiles into one graph shared by every block of its class (the engine's hooks
run outside compiled regions), so compiling per block gives the fused kernels without graph breaks
at unit boundaries inside a graph. Called after `st.shard`, so activation checkpointing (applied by
st.shard) is inside the compiled forward and recomputation is compiled too.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..core.gathered import GatheredUnit
from ..core.partition import clean_name, repeated_blocks
from ..core.shard_module import runtime_of


def compile_blocks(model: nn.Module, **compile_options: Any) -> list[str]:
    """`module.compile(**compile_options)` on every unit whose class repeats (the blocks); where no class
    repeats, on every unit but the root. Returns the compiled units' names."""
    runtime = runtime_of(model)
    modules = dict(model.named_modules())
    units = {u.name: _module_of(modules, u.name) for u in runtime.units[1:] if isinstance(u, GatheredUnit)}
    blocks = {id(m) for m in repeated_blocks(list(units.values()))}
    compiled = [name for name, module in units.items() if id(module) in blocks]
    for name in compiled:
        units[name].compile(**compile_options)
    return compiled


def _module_of(modules: dict[str, nn.Module], name: str) -> nn.Module:
    """The unit's module by its clean name (the path may hold `_orig_mod` segments)."""
    if name in modules:
        return modules[name]
    return next(m for path, m in modules.items() if clean_name(path) == name)
