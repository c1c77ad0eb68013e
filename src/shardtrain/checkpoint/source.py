"""A saved module as a source of tensors by name, and loading it into a sharded module.

Both formats describe a module the same way in metadata.json (its units' slots and its buffers);
they differ only in where the bytes are: `ShardedSource` reads flat shards cut for the saved world
size, `FullSource` reads whole tensors. Loading asks for exactly the elements this rank's shard
holds, `[param_start, param_start + numel)` of each flattened parameter, so any saved world size
loads at any current one. (`ops.state_dict.load_full_state_dict` would need every full tensor in
memory on every rank; reading only the rows a rank holds keeps a large model's load at a shard.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from ..core.flat import ParamSlot
from ..core.shard import runtime_of
from .format import short_list
from .local import held_piece, persistent_buffers


class ModuleSource(ABC):
    """Names and shapes of a saved module (aliases of tied weights included)."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.param_shapes: dict[str, tuple[int, ...]] = {}
        self.canonical: dict[str, str] = {}
        for unit in record["units"]:
            for slot in unit["slots"]:
                for name in (slot["fqn"], *slot["aliases"]):
                    self.param_shapes[name] = tuple(slot["shape"])
                    self.canonical[name] = slot["fqn"]
        self.buffer_shapes = {name: tuple(b["shape"]) for name, b in record["buffers"].items()}

    def saved_name(self, slot: ParamSlot) -> str | None:
        """The saved canonical name of the parameter `slot` is (same shape), None when not saved."""
        for name in (slot.fqn, *slot.aliases):
            if self.param_shapes.get(name) == slot.shape:
                return self.canonical[name]
        return None

    @abstractmethod
    def read_param(self, name: str, start: int, numel: int) -> torch.Tensor:
        """Elements `[start, start + numel)` of saved parameter `name`, flattened."""

    @abstractmethod
    def read_state(self, optimizer: str, key: str, name: str, start: int, numel: int) -> torch.Tensor:
        """The same elements of optimizer `optimizer`'s elementwise state `key` of parameter `name`."""

    @abstractmethod
    def read_buffer(self, name: str) -> torch.Tensor: ...


def restore_module(module: nn.Module, key: str, source: ModuleSource, *, strict: bool) -> None:
    """Copy the saved parameters (this rank's pieces) and buffers into sharded `module`, in place."""
    runtime = runtime_of(module)
    buffers = persistent_buffers(module)
    current = {name: slot.shape for unit in runtime.units for slot in unit.layout.slots
               for name in (slot.fqn, *slot.aliases)}
    current.update({name: tuple(b.shape) for name, b in buffers.items()})
    saved = {**source.param_shapes, **source.buffer_shapes}
    missing = sorted(current.keys() - saved.keys())
    unexpected = sorted(saved.keys() - current.keys())
    mis_shaped = [f"{n}: checkpoint {saved[n]} vs model {current[n]}"
                  for n in sorted(current.keys() & saved.keys()) if saved[n] != current[n]]
    problems = [f"{what} {short_list(names)}" for what, names in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", mis_shaped)) if names]
    if strict and problems:
        raise ValueError(f"the checkpoint does not match state[{key!r}] ({type(module).__name__}): "
                         f"{', '.join(problems)}; load a checkpoint of this model, or pass strict=False to load "
                         "the matching part")
    with torch.no_grad():
        for unit in runtime.units:
            for slot, param in zip(unit.layout.slots, unit.shard_params):
                name = source.saved_name(slot)
                if name is None:
                    continue
                held = held_piece(unit, slot)
                # Note: an in-place copy into the shard bumps its version, which makes the engine
                # re-gather any resident unsharded copy before the next forward.
                param.copy_(source.read_param(name, held.param_start, held.numel).reshape(param.shape))
        for name, buffer in buffers.items():
            if source.buffer_shapes.get(name) == tuple(buffer.shape):
                buffer.copy_(source.read_buffer(name))
