"""A fused optimizer's step counts as DTensors, so that DTensor's dispatch finds their specs ready.

A fused optimizer passes each parameter's 0-dim step count to its kernel beside the sharded DTensor
parameters, and DTensor's dispatch built a fresh spec for every plain count on every step (the host
time it cost: BENCHMARKS.md, 'FSDP × tensor parallel: the 2-D code path against the 1-D one'). After
each step a global post-hook makes each such count the replicated DTensor dispatch would have built,
over the same storage; the count's value and the update are unchanged, and counts that live elsewhere
than their parameter's rows (non-fused, offloaded) stay plain.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

_sharded: WeakIdKeyDictionary = WeakIdKeyDictionary()  # the sharded parameters (DTensors) -> True
_specs: dict[tuple[DeviceMesh, torch.dtype], DTensorSpec] = {}
_hook = None


def track(param: torch.Tensor) -> None:
    """`param` is a sharded parameter (a DTensor): its step count may be wrapped."""
    global _hook
    _sharded[param] = True
    if _hook is None:
        _hook = register_optimizer_step_post_hook(lambda opt, args, kwargs: wrap_counts(opt))


def wrap_counts(optimizer: torch.optim.Optimizer) -> None:
    """Make the plain step counts of `optimizer`'s fused groups' sharded parameters DTensors."""
    state = optimizer.state
    for group in optimizer.param_groups:
        if not group.get("fused"):
            continue
        for p in group["params"]:
            entries = state.get(p)
            if not entries:
                continue
            count = entries.get("step")
            if type(count) is torch.Tensor and _wrappable(count, p):
                entries["step"] = DTensor(count, _spec(p.device_mesh, count.dtype), requires_grad=False)


def _wrappable(count: torch.Tensor, p: torch.Tensor) -> bool:
    """A 0-dim count where the sharded parameter `p`'s rows live, on its mesh's device type."""
    if p not in _sharded or count.dim():
        return False
    local = p._local_tensor  # type: ignore[attr-defined]
    return count.device == local.device and count.device.type == p.device_mesh.device_type  # type: ignore[attr-defined]


def _spec(mesh: DeviceMesh, dtype: torch.dtype) -> DTensorSpec:
    key = (mesh, dtype)
    spec = _specs.get(key)
    if spec is None:
        meta = TensorMeta(torch.Size(()), (), dtype)
        spec = _specs[key] = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=meta)
    return spec
