"""A saved module as a source of tensors by name, and loading it into a sharded module.

Both formats describe a module the same way in metadata.json (its parameters and its buffers); they
differ only in where the bytes are: `ShardedSource` reads the rows cut for the saved world size,
`FullSource` reads whole tensors. Loading asks for exactly the rows this rank holds of each
parameter (as elements `[start, start + numel)` of the flattened parameter), so any saved world
size loads at any current one, and no rank reads more than its share.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from ..core.held import held_params
from ..core.param_layout import ParamShard
from ..core.shard_module import runtime_of
from ..tp.boxes import Box
from .format import dtype_of, saved_params_kind, saves, short_list
from .this_rank import persistent_buffers


class ModuleSource(ABC):
    """Names, shapes and dtypes of a saved module's parameters (aliases of tied weights included)."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.param_shapes: dict[str, tuple[int, ...]] = {}
        self.param_dtypes: dict[str, torch.dtype] = {}
        self.canonical: dict[str, str] = {}
        self.params: list[tuple[str, tuple[str, ...]]] = []  # (canonical name, aliases), in saved order
        self.splits: dict[str, str | None] = {}  # canonical name -> how tensor parallelism split it
        for p in saved_params(record):
            self.params.append((p["fqn"], tuple(p["aliases"])))
            self.splits[p["fqn"]] = p.get("split")
            for name in (p["fqn"], *p["aliases"]):
                self.param_shapes[name] = tuple(p["shape"])
                self.param_dtypes[name] = dtype_of(p["dtype"])
                self.canonical[name] = p["fqn"]
        self.saved = saved_params_kind(record)  # "all", or "trainable" (only those were saved)
        self.buffer_shapes = {name: tuple(b["shape"]) for name, b in record["buffers"].items()}
        self.buffer_dtypes = {name: dtype_of(b["dtype"]) for name, b in record["buffers"].items()}

    def saved_name(self, shard: ParamShard, shape: tuple[int, ...]) -> str | None:
        """The saved canonical name of the parameter `shard` describes, of global `shape`; None when not saved."""
        for name in (shard.fqn, *shard.aliases):
            if self.param_shapes.get(name) == shape:
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

    def read_param_box(self, name: str, box: Box) -> torch.Tensor:
        """`box` (tp/boxes.py) of saved parameter `name`: its rows read whole, then its columns cut."""
        return self._cut(name, box, lambda start, numel: self.read_param(name, start, numel))

    def read_state_box(self, optimizer: str, key: str, name: str, box: Box) -> torch.Tensor:
        return self._cut(name, box, lambda start, numel: self.read_state(optimizer, key, name, start, numel))

    def _cut(self, name: str, box: Box, read) -> torch.Tensor:
        shape = self.param_shapes[name]
        if not shape:
            return read(0, 1).view(())
        row = math.prod(shape[1:])
        return box.cut_cols(read(box.rows[0] * row, (box.rows[1] - box.rows[0]) * row).view(-1, *shape[1:]))


def saved_params(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The parameters of a module record: listed (version 2), or the slots of its units (version 1)."""
    if "params" in record:
        return record["params"]
    return [
        {"fqn": s["fqn"], "aliases": s["aliases"], "shape": s["shape"], "dtype": unit["dtype"]}
        for unit in record["units"]
        for s in unit["slots"]
    ]


def restore_module(module: nn.Module, key: str, source: ModuleSource, *, strict: bool, params: str = "all") -> None:
    """Copy the saved parameters (this rank's rows) and buffers into sharded `module`, in place.

    `params="trainable"` loads only the parameters that require gradients (the others keep their
    values); a checkpoint saved with `params="trainable"` loads strictly only that way.
    """
    runtime = runtime_of(module)
    if strict and params == "all" and source.saved == "trainable":
        raise ValueError(
            f"the checkpoint holds only the trainable parameters of state[{key!r}] (saved with "
            "params='trainable'); load the others first (e.g. st.load_pretrained from the pretrained "
            "folder) and pass params='trainable' to load_checkpoint"
        )
    buffers = persistent_buffers(module)
    held = list(held_params(runtime))
    current = {name: h.shape for h in held if saves(h.requires_grad, params) for name in h.names}
    current.update({name: tuple(b.shape) for name, b in buffers.items()})
    skipped = {name for h in held if not saves(h.requires_grad, params) for name in h.names}
    saved = {**source.param_shapes, **source.buffer_shapes}
    missing = sorted(current.keys() - saved.keys())
    unexpected = sorted(saved.keys() - current.keys() - skipped)
    mis_shaped = [
        f"{n}: checkpoint {saved[n]} vs model {current[n]}"
        for n in sorted(current.keys() & saved.keys())
        if saved[n] != current[n]
    ]
    problems = [
        f"{what} {short_list(names)}"
        for what, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", mis_shaped))
        if names
    ]
    if strict and problems:
        raise ValueError(
            f"the checkpoint does not match state[{key!r}] ({type(module).__name__}): "
            f"{', '.join(problems)}; load a checkpoint of this model, or pass strict=False to load "
            "the matching part"
        )
    with torch.no_grad():
        for h in held:
            name = source.saved_name(h.layout, h.shape)
            if name is None or not saves(h.requires_grad, params):
                continue
            local = h.local
            # Note: an in-place copy into the shard bumps its version, which makes the engine
            # re-gather any resident unsharded copy before the next forward.
            local.copy_(source.read_param_box(name, h.box).view(local.shape))
        for name, buffer in buffers.items():
            if source.buffer_shapes.get(name) == tuple(buffer.shape):
                buffer.copy_(source.read_buffer(name))
