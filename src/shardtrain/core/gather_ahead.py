"""Gather the next forward's units while the optimizer steps.

Why: on the GPU an all-gather issued during the forward slows the GEMMs beside it by most of its own
duration (cuBLAS's and cuDNN's persistent kernels hold every SM and cannot share them with NCCL's
CTAs), while the optimizer step is memory-bound elementwise work that runs well beside a
collective. So when `optimizer.step()` runs on an optimizer that holds a sharded model's parameters,
the step is split by unit in forward order: each unit's parameters are stepped, then its all-gather
for the next forward is issued while the later units are stepped. Splitting is exact: a
per-parameter optimizer does the same arithmetic on a parameter whichever others it steps with.

Bounds: the unsharded buffers gathered ahead must fit in half the room below the peak allocated
memory seen so far (the other half for the step's own temporaries), so gathering ahead never raises
the peak; every rank gathers the same units (collectives must be issued in the same order on all
ranks), the fewest any rank can afford. Only torch's per-parameter optimizers are split, and only
units whose trainable parameters that optimizer holds in full; a step with a closure is left alone.
The hooks are torch's global optimizer step hooks, so plain `opt.step()` gets this with no change.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

if TYPE_CHECKING:
    from .runtime import Runtime
    from .unit import ShardUnit

# Note: exact types; a subclass may override step() with arithmetic across parameters.
PER_PARAMETER_OPTIMIZERS = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
    torch.optim.ASGD,
})

# Note: a list in creation order, the same on every rank: the gathers and the agreements run in it.
_runtimes: list[weakref.ref[Runtime]] = []
_hidden_grads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> [(param, grad)]
_hooks: list = []


def enable(runtime: Runtime) -> None:
    """Let `runtime`'s units be gathered during the optimizer step that follows each backward."""
    _runtimes.append(weakref.ref(runtime))
    if not _hooks:
        _hooks.append(register_optimizer_step_pre_hook(_before_step))
        _hooks.append(register_optimizer_step_post_hook(_after_step))


def headroom_bytes(device: torch.device) -> int | None:
    """Bytes that may be gathered ahead now: half the room below the peak allocated so far.

    None where gathering ahead does not pay (the CPU: no GEMMs for a collective to slow down); the
    device type is the same on every rank, so they all skip the agreement alike.
    """
    if device.type != "cuda":
        return None
    return max(0, torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)) // 2


def _before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if type(optimizer) not in PER_PARAMETER_OPTIMIZERS or _has_closure(args, kwargs) or not _runtimes:
        return
    _runtimes[:] = [ref for ref in _runtimes if ref() is not None]
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    hidden = []
    for runtime in [ref() for ref in _runtimes]:
        units = [u for u in runtime.units_gathered_each_step() if _holds_all(held, u)] if runtime else []
        if not units:
            continue
        for unit in units[:_affordable(runtime, units)]:
            _step_only(optimizer, unit, args, kwargs)
            unit.gather_ahead()
            hidden += [(p, p.grad) for p in unit.shard_params if p.grad is not None]
    # Note: the step proper must skip what was stepped already; torch's optimizers skip a
    # parameter whose .grad is None. The gradients are back right after it (_after_step).
    for p, _ in hidden:
        p.grad = None
    if hidden:
        _hidden_grads[optimizer] = hidden


def _after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for p, grad in _hidden_grads.pop(optimizer, ()):
        p.grad = grad


def _has_closure(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("closure") is not None or any(callable(a) for a in args[1:])


def _holds_all(held: set[int], unit: ShardUnit) -> bool:
    trainable = [p for p in unit.shard_params if p.requires_grad]
    return bool(trainable) and all(id(p) in held for p in trainable)


def _affordable(runtime: Runtime, units: list[ShardUnit]) -> int:
    """How many of `units` (a prefix) every rank can gather ahead."""
    room, count = headroom_bytes(runtime.groups.device), 0
    if room is None:
        return 0
    for unit in units:
        room -= unit.unsharded_nbytes
        if room < 0:
            break
        count += 1
    group = runtime.control_group
    if group is not None and dist.get_world_size(group) > 1:
        agreed = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        count = int(agreed.item())
    return count


def _step_only(optimizer: torch.optim.Optimizer, unit: ShardUnit, args: tuple, kwargs: dict[str, Any]) -> None:
    """Run the optimizer's own step on `unit`'s parameters alone (no hooks, param groups restored)."""
    mine = {id(p) for p in unit.shard_params}
    groups = optimizer.param_groups
    saved = [group["params"] for group in groups]
    try:
        for group, params in zip(groups, saved):
            group["params"] = [p for p in params if id(p) in mine]
        # Note: the class's step without torch's hook wrapper, so that hooks fire once per step.
        type(optimizer).step.__wrapped__(optimizer, *args[1:], **kwargs)
    finally:
        for group, params in zip(groups, saved):
            group["params"] = params
