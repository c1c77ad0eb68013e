"""`st.clip_grad_norm_`: the global gradient norm of a sharded model, identical on every rank."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..core.held import tensor_parallel_of
from ..core.shard_module import runtime_of
from ..core.sharded_param import local_of


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


ROW = 1024  # elements per partial norm: few enough that fp32 accumulation within one stays exact to rounding


def _device_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The `norm_type` norm of `grads` (all on one device), as a float64 scalar on that device.

    Note: one fp32 reduction over a long tensor loses precision with its length (torch's CPU kernel
    keeps a single vector of running sums), and the flat gradients hold many parameters' rows. So each
    tensor is cut into rows of `ROW` elements, each row's norm is taken in (at least) fp32 by one
    reduction per tensor, the tails shorter than a row by one foreach call, and the row norms are
    combined in float64: as exact as a float64 norm of the gradients, at one small fp32 value per row.
    """
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    rows, tails = [], []
    for grad in grads:
        flat = grad.reshape(-1)
        whole = flat.numel() // ROW * ROW
        if whole:
            rows.append(torch.linalg.vector_norm(flat[:whole].view(-1, ROW), norm_type, dim=1, dtype=dtype))
        if whole < flat.numel():
            tails.append(flat[whole:])
    if tails:
        rows.append(torch.stack(torch._foreach_norm(tails, norm_type, dtype=dtype)))
    return torch.linalg.vector_norm(torch.cat(rows), norm_type, dtype=torch.float64)


def grad_norm(model: nn.Module, *, norm_type: float = 2.0) -> torch.Tensor:
    """Global `norm_type` norm of all gradients (fp32), the same value on every rank.

    Accumulated in float64 across tensors and ranks (`_device_norm`), so it is at least as exact as
    torch's `clip_grad_norm_` over the unsharded gradients, whatever the sharding.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type={norm_type} must be positive, e.g. 2.0, or math.inf for the largest |gradient|")
    runtime = runtime_of(model)
    grads = [g for g in _local_grads(model, for_norm=True) if g.numel()]
    device = runtime.comm.device
    # Note: with (partial) offload some gradients are on the host; each device's norm is taken where
    # they live, then combined on the device, where the collective runs.
    norms = torch.stack(
        [_device_norm(on_one, norm_type).to(device) for on_one in _by_device(grads).values()]
        or [torch.zeros((), dtype=torch.float64, device=device)]
    )
    local = norms.max() if math.isinf(norm_type) else (norms**norm_type).sum()
    tp = tensor_parallel_of(runtime)
    # Note: replicas hold identical shards, so the shard group (and the tp ranks) cover every element once.
    group = tp.norm_group if tp is not None else runtime.comm.shard
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
    return (local if math.isinf(norm_type) else local ** (1.0 / norm_type)).float()


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
    if not runtime_of(model, settle=False).step_hook.allow_clipping(coef, total, max_norm):
        return total  # units stepped during backward read these gradients; the coefficient is 1
    for where, on_one in _by_device(_local_grads(model, for_norm=False)).items():
        torch._foreach_mul_(on_one, coef.to(where))
    return total
