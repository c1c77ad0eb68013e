"""Bring a unit's parameters to the device as one flat buffer and keep this rank's shard.

For a model built on the meta device, modules are materialised unit by unit (their own parameters
and buffers allocated on the device, then `param_init_fn(module)` or `module.reset_parameters()`),
so no rank ever holds more than one unit unsharded.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..planning.units import Occurrence, UnitSpec
from .flat import FlatLayout


class Materializer:
    def __init__(self, *, device: torch.device, param_init_fn: Callable[[nn.Module], None] | None,
                 occurrences: dict[int, list[Occurrence]]) -> None:
        self.device = device
        self.param_init_fn = param_init_fn
        self.occurrences = occurrences  # id(original parameter) -> where it is registered
        self._done: set[int] = set()

    def materialize(self, modules: list[nn.Module]) -> None:
        """Allocate and initialise every module in `modules` that still has meta state (each once)."""
        for module in modules:
            if id(module) in self._done:
                continue
            self._done.add(id(module))
            meta_params = [(n, p) for n, p in module._parameters.items() if p is not None and p.is_meta]
            meta_buffers = [(n, b) for n, b in module._buffers.items() if b is not None and b.is_meta]
            if not meta_params and not meta_buffers:
                continue
            for _, p in meta_params:
                new = nn.Parameter(torch.empty_like(p, device=self.device), requires_grad=p.requires_grad)
                for occ in self.occurrences[id(p)]:
                    occ.module._parameters[occ.attr] = new
                self.occurrences[id(new)] = self.occurrences[id(p)]
            for name, b in meta_buffers:
                module._buffers[name] = torch.empty_like(b, device=self.device)
            self._initialise(module, has_params=bool(meta_params))

    def _initialise(self, module: nn.Module, *, has_params: bool) -> None:
        with torch.no_grad():
            if self.param_init_fn is not None:
                self.param_init_fn(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            elif has_params:
                raise ValueError(
                    f"{type(module).__name__} was built on the meta device but has no reset_parameters(); "
                    "pass param_init_fn=fn(module) to st.shard to initialise its parameters"
                )


def current_tensors(spec: UnitSpec) -> list[torch.Tensor]:
    """The unit's parameters as currently registered (after materialisation replaced them)."""
    return [occ[0].module._parameters[occ[0].attr] for occ in spec.occurrences]


def flatten_and_shard(tensors: list[torch.Tensor], layout: FlatLayout, *, device: torch.device, shard_rank: int,
                      broadcast_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Copy the parameters into one padded flat buffer on `device` and return this rank's shard.

    With `broadcast_group`, rank 0's values are broadcast first (sync_module_states).
    """
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        names = [s.fqn for s in layout.slots]
        raise ValueError(f"parameters {names} of one unit mix dtypes {sorted(map(str, dtypes))}; build the model "
                         "in one dtype and use mixed_precision= for lower-precision compute")
    dtype = dtypes.pop() if dtypes else torch.float32
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    with torch.no_grad():
        for slot, t in zip(layout.slots, tensors):
            flat[slot.offset:slot.end].copy_(t.detach().reshape(-1))
    if broadcast_group is not None:
        dist.broadcast(flat, src=dist.get_global_rank(broadcast_group, 0), group=broadcast_group)
    if layout.shard_world == 1:
        return flat
    lo, hi = layout.shard_range(shard_rank)
    return flat[lo:hi].clone()
