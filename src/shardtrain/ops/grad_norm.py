"""`st.clip_grad_norm_`: the global gradient norm of a sharded model, identical on every rank."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..core.shard import runtime_of


def _local_grads(model: nn.Module) -> list[torch.Tensor]:
    """This rank's gradient tensors: one flat tensor per unit where `.grad` still points into it."""
    grads = []
    for unit in runtime_of(model).units:
        params = [p for p in unit.shard_params if p.requires_grad]
        published = [p.grad for p in params if p.grad is not None]
        if not published:
            continue
        if unit.owns_grads():
            grads.append(unit.sharded_grad)
        else:
            grads.extend(published)
    return grads


def grad_norm(model: nn.Module, *, norm_type: float = 2.0) -> torch.Tensor:
    """Global `norm_type` norm of all gradients (fp32), the same value on every rank."""
    runtime = runtime_of(model)
    grads = _local_grads(model)
    device = runtime.groups.device
    norm_type = float(norm_type)
    if grads:
        norms = torch.stack([n.float() for n in torch._foreach_norm(grads, norm_type)])
        local = norms.max() if math.isinf(norm_type) else (norms ** norm_type).sum()
    else:
        local = torch.zeros((), device=device)
    local = local.to(device)  # offloaded gradients are on the host; the collective runs on the device
    group = runtime.groups.shard
    if group is not None and runtime.groups.shard_world > 1:
        # Note: replicas hold identical shards, so the shard group alone covers every element once.
        dist.all_reduce(local, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
    return local if math.isinf(norm_type) else local ** (1.0 / norm_type)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most `max_norm`; return the norm before."""
    if max_norm <= 0:
        raise ValueError(f"clip_grad_norm_: max_norm={max_norm} must be positive")
    total = grad_norm(model, norm_type=norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total gradient norm is {total.item()}; "
                           "pass error_if_nonfinite=False to skip this check")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = _local_grads(model)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
