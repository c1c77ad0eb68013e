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


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups


def _powered_total(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """max of the norms (inf-norm), else the sum of their `norm_type` powers (one device)."""
    stacked = torch.stack([n.float() for n in norms])
    return stacked.max() if math.isinf(norm_type) else (stacked ** norm_type).sum()


def grad_norm(model: nn.Module, *, norm_type: float = 2.0) -> torch.Tensor:
    """Global `norm_type` norm of all gradients (fp32), the same value on every rank."""
    runtime = runtime_of(model)
    grads = _local_grads(model)
    device = runtime.groups.device
    norm_type = float(norm_type)
    # Note: with (partial) offload some gradients are on the host; each device's norms are combined
    # where they live, then on the device, where the collective runs.
    partial = torch.stack([_powered_total(torch._foreach_norm(on_one, norm_type), norm_type).to(device)
                           for on_one in _by_device(grads).values()] or [torch.zeros((), device=device)])
    local = partial.max() if math.isinf(norm_type) else partial.sum()
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
    for where, on_one in _by_device(_local_grads(model)).items():
        torch._foreach_mul_(on_one, coef.to(where))
    return total
