"""Bring a unit's parameters to the device and keep this rank's rows of each.

For a model built on the meta device, modules are materialised unit by unit (their own parameters
and buffers allocated on the device, then initialised), so no rank ever holds more than one unit
unsharded. A parameter tensor parallelism already split on the meta device (a DTensor) is initialised
whole, exactly as without tensor parallelism, then split over its mesh as `parallelize_module` splits
a materialised one (rank 0 of the mesh scatters its values): the model's values do not depend on the
mesh, and no rank holds more than one unit's whole weights. A module is initialised by `param_init_fn(module)` when given; else, inside a Hugging Face
model, by that model's own `_init_weights(module)` (what `from_config` would have run, rotary tables
included); else by `module.reset_parameters()`. A module with meta state and none of these is an
error that names it: its tensors would otherwise hold whatever memory they were given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .param_layout import FlatGroup, UnitLayout
from .partition import Occurrence, UnitSpec


class Materializer:
    def __init__(
        self,
        *,
        root: nn.Module,
        device: torch.device,
        param_init_fn: Callable[[nn.Module], None] | None,
        occurrences: dict[int, list[Occurrence]],
    ) -> None:
        self.device = device
        self.param_init_fn = param_init_fn
        self.occurrences = occurrences  # id(original parameter) -> where it is registered
        self._done: set[int] = set()
        self._default_init = DefaultInit(root)

    def materialize(self, modules: list[nn.Module]) -> None:
        """Allocate and initialise every module in `modules` that still has meta state (each once)."""
        for module in modules:
            if id(module) in self._done:
                continue
            self._done.add(id(module))
            meta_params = [(n, p) for n, p in module._parameters.items() if p is not None and p.is_meta]
            meta_buffers = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
            if not meta_params and not meta_buffers:
                continue
            split: list[tuple[DTensor, torch.Tensor]] = []
            for _, p in meta_params:
                whole = torch.empty(p.shape, dtype=p.dtype, device=self.device)  # a DTensor's global shape
                self._install(p, nn.Parameter(whole, requires_grad=p.requires_grad))
                if isinstance(p, DTensor):
                    split.append((p, whole))
            for name in meta_buffers:
                module._buffers[name] = torch.empty_like(cast(torch.Tensor, module._buffers[name]), device=self.device)
            self._initialise(module, state=[n for n, _ in meta_params] + meta_buffers)
            for meta, whole in split:
                local = distribute_tensor(whole, meta.device_mesh, meta.placements, src_data_rank=0)
                self._install(meta, nn.Parameter(local, requires_grad=meta.requires_grad))

    def _install(self, original: torch.Tensor, new: nn.Parameter) -> None:
        """Register `new` wherever the meta parameter `original` is registered."""
        for occ in self.occurrences[id(original)]:
            occ.module._parameters[occ.attr] = new
        self.occurrences[id(new)] = self.occurrences[id(original)]

    def _initialise(self, module: nn.Module, *, state: list[str]) -> None:
        with torch.no_grad():
            if self.param_init_fn is not None:
                self.param_init_fn(module)
            else:
                self._default_init(module, state=state)


class DefaultInit:
    """What st.shard runs on a module of `root` built on the meta device when no `param_init_fn` is
    given (module docstring); a custom `param_init_fn` (peft's adapters) falls back to it for the rest."""

    def __init__(self, root: nn.Module) -> None:
        self._paths = {id(m): path for path, m in root.named_modules(remove_duplicate=False)}
        self._hf_owner = _hugging_face_owners(root)

    def __call__(self, module: nn.Module, *, state: list[str] | None = None) -> None:
        if id(module) in self._hf_owner:
            self._hf_owner[id(module)]._init_weights(module)
        elif hasattr(module, "reset_parameters"):
            cast(Any, module).reset_parameters()
        else:
            path = self._paths.get(id(module), "?") or "<root>"
            state = state if state is not None else [*module._parameters, *module._buffers]
            raise ValueError(
                f"{type(module).__name__} at '{path}' was built on the meta device with {state}, but has no "
                "reset_parameters() to fill them; give it one, or pass param_init_fn=fn(module) to st.shard"
            )


def _hugging_face_owners(root: nn.Module) -> dict[int, Any]:
    """Each module inside a Hugging Face model (one with `config` and `_init_weights`), mapped to the
    innermost such model holding it."""
    owners: dict[int, nn.Module] = {}

    def visit(module: nn.Module, owner: nn.Module | None) -> None:
        if hasattr(module, "_init_weights") and hasattr(module, "config"):
            owner = module
        if owner is not None:
            owners[id(module)] = owner
        for child in module.children():
            visit(child, owner)

    visit(root, None)
    return owners


def current_tensors(spec: UnitSpec) -> list[torch.Tensor]:
    """The unit's parameters as currently registered (after materialisation replaced them)."""
    return [cast(torch.Tensor, occ[0].module._parameters[occ[0].attr]) for occ in spec.occurrences]


def cut_shards(
    layout: UnitLayout,
    tensors: list[torch.Tensor],
    *,
    rank: int,
    device: torch.device,
    broadcast_group: dist.ProcessGroup | None,
) -> list[torch.Tensor]:
    """This rank's shard of every group of `layout`, filled from the whole `tensors` (one per parameter).

    With `broadcast_group`, rank 0's values are broadcast first (sync_module_states).
    """
    return [
        _cut_group(group, layout, tensors, rank=rank, device=device, broadcast_group=broadcast_group)
        for group in layout.groups
    ]


def _cut_group(
    group: FlatGroup,
    layout: UnitLayout,
    tensors: list[torch.Tensor],
    *,
    rank: int,
    device: torch.device,
    broadcast_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    members = [layout.params[i] for i in group.members]
    values = [tensors[i].detach().to(device=device, dtype=group.dtype) for i in group.members]
    if broadcast_group is not None:
        whole = torch.cat([v.reshape(-1) for v in values]) if values else torch.zeros(0, device=device)
        dist.broadcast(whole, src=dist.get_global_rank(broadcast_group, 0), group=broadcast_group)
        values = [w.view(m.shape) for w, m in zip(torch.split(whole, [m.numel for m in members]), members)]
    shard = torch.zeros(group.shard_numel, dtype=group.dtype, device=device)
    with torch.no_grad():
        for m, value, start in zip(members, values, group.shard_offsets):
            if not group.sharded:
                shard[start : start + 1].copy_(value.reshape(1))
                continue
            first, stop = m.held_rows(rank)
            rows = value.reshape(m.rows, m.row_numel)[first:stop]
            shard[start : start + rows.numel()].copy_(rows.reshape(-1))
    return shard
