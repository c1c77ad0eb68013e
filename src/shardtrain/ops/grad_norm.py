"""`st.clip_grad_norm_`: the global gradient norm of a sharded model, identical on every rank."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..core.shard_module import runtime_of
from ..core.sharded_param import local_of
from ..core.tensor_parallel import tensor_parallel_of


def _local_grads(model: nn.Module, *, for_norm: bool) -> list[torch.Tensor]:
    """This rank's gradient tensors: the flat sharded gradients where `.grad` still points into them,
    else each `.grad`'s rows.

    Note: every rank holds a 0-dim parameter's whole gradient; `for_norm`, only shard rank 0 counts it,
    so that each element of the model's gradient enters the norm once. Under tensor parallelism every
    tp rank holds a replicated parameter's rows too: only tp rank 0 counts them, so on the other tp
    ranks the norm takes each parameter's gradient of a unit that mixes split and replicated ones
    (its flat buffers hold both); tp rank 0 counts all its rows and reads the flat buffers, as 1-D.
    """
    runtime = runtime_of(model)
    counts_whole = runtime.comm.shard_rank == 0 or not for_norm
    tp = tensor_parallel_of(runtime) if for_norm else None
    grads = []
    for unit in runtime.units:
        if not any(p.grad is not None for p in unit.params):
            continue
        if unit.owns_grads() and (tp is None or tp.counts_every(unit.layout.params)):
            grads += [buf.grad for buf in unit.buffers if buf.grad is not None and (buf.group.sharded or counts_whole)]
        else:
            grads += [
                local_of(p.grad)
                for p, s in zip(unit.params, unit.layout.params)
                if p.grad is not None and (s.shape or counts_whole) and (tp is None or tp.counts_once(s))
            ]
    return grads


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups


def _powered_total(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """max of the norms (inf-norm), else the sum of their `norm_type` powers (one device)."""
    stacked = torch.stack([n.float() for n in norms])
    return stacked.max() if math.isinf(norm_type) else (stacked**norm_type).sum()


def grad_norm(model: nn.Module, *, norm_type: float = 2.0) -> torch.Tensor:
    """Global `norm_type` norm of all gradients (fp32), the same value on every rank."""
    runtime = runtime_of(model)
    grads = _local_grads(model, for_norm=True)
    device = runtime.comm.device
    norm_type = float(norm_type)
    # Note: with (partial) offload some gradients are on the host; each device's norms are combined
    # where they live, then on the device, where the collective runs.
    partial = torch.stack(
        [
            _powered_total(torch._foreach_norm(on_one, norm_type), norm_type).to(device)
            for on_one in _by_device(grads).values()
        ]
        or [torch.zeros((), device=device)]
    )
    local = partial.max() if math.isinf(norm_type) else partial.sum()
    tp = tensor_parallel_of(runtime)
    # Note: replicas hold identical shards, so the shard group (and the tp ranks) cover every element once.
    group = tp.norm_group if tp is not None else runtime.comm.shard
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
    return local if math.isinf(norm_type) else local ** (1.0 / norm_type)


def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most `max_norm`; return the norm before."""
    for what, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"clip_grad_norm_: {what}={value!r} must be a number, e.g. {what}=1.0")
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm={max_norm} must be positive")
    total = grad_norm(model, norm_type=norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total gradient norm is {total.item()}; "
            "pass error_if_nonfinite=False to skip this check"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    steps = runtime_of(model, settle=False).host_steps
    if steps is not None and not steps.early.allow_clipping(coef, total, max_norm):
        return total  # units stepped during backward read these gradients; the coefficient is 1
    for where, on_one in _by_device(_local_grads(model, for_norm=False)).items():
        torch._foreach_mul_(on_one, coef.to(where))
    return total
