"""One unit's optimizer step: a view of the user's optimizer over the unit's local rows, exactly.

The host step (offload/host_step.py) steps each unit with a shallow copy of the user's optimizer (same
class, same code path: fused, foreach or per tensor as chosen) whose param groups hold the unit's
local rows as plain tensors and the hyperparameters as they were when `step()` was called (an LR
scheduler may change them right after), and whose state entries are the local rows of the user's
state tensors, updated in place. AdamW, Adam and SGD update each element from that element alone, so
stepping per unit is bitwise the single step. Everything global (clipping's norm, the non-finite
verdict, a loss scale) is already decided when `step()` is called. Plain tensors also spare the host
step DTensor's dispatch.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.sharded_param import local_of

if TYPE_CHECKING:
    from ..core.unit import ShardUnit

# Optimizers whose update of an element reads that element's parameter, gradient and state only.
SPLITTABLE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)


@dataclass(frozen=True, kw_only=True)
class UnitStep:
    """One unit's deferred step: the optimizer view that steps it and the gradients it reads."""

    unit: ShardUnit
    view: torch.optim.Optimizer
    grads: list[tuple[torch.Tensor, torch.Tensor]]  # (local parameter alias, local gradient)
    ready: tuple[torch.cuda.Event, ...] = ()  # the gradients' copies to the host have landed (in backward)
    in_backward: bool = False


def unit_step(
    unit: ShardUnit,
    optimizer: torch.optim.Optimizer,
    grads: list[tuple[nn.Parameter, torch.Tensor]],
    group_of: dict[int, int],
    *,
    groups: list[dict[str, Any]],
    amp: dict[str, torch.Tensor],
) -> UnitStep:
    """The optimizer view stepping `unit`: its local rows per group, the state's local rows."""
    view = copy.copy(optimizer)  # same class and defaults; hooks and groups replaced below
    view.state = defaultdict(dict)
    per_group: dict[int, dict[str, Any]] = {}
    pairs = []
    for p, grad in grads:
        alias = local_of(p).detach()  # shares the rows; its .grad is the worker's alone
        j = group_of[id(p)]
        per_group.setdefault(j, dict(groups[j], params=[]))["params"].append(alias)
        view.state[alias] = {
            k: local_of(v) if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()
        }
        pairs.append((alias, local_of(grad)))
    view.param_groups = [per_group[j] for j in sorted(per_group)]
    for name, value in amp.items():
        setattr(view, name, value)
    return UnitStep(unit=unit, view=view, grads=pairs)


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters as they are now."""
    return [{k: _frozen(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def amp_of(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The grad_scale / found_inf a GradScaler handed a fused optimizer for this step, if any."""
    return {
        name: getattr(optimizer, name).clone()
        for name in ("grad_scale", "found_inf")
        if isinstance(getattr(optimizer, name, None), torch.Tensor)
    }


def unsplittable(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> str | None:
    """Why `optimizer.step(*args[1:], **kwargs)` cannot be stepped per unit, or None."""
    if type(optimizer) not in SPLITTABLE:
        return f"stepping per unit is exact for {', '.join(c.__name__ for c in SPLITTABLE)} only"
    if len(args) > 1 or kwargs:
        return "step() was given a closure"
    if any(g.get("differentiable") for g in optimizer.param_groups):
        return "differentiable=True"
    return None


def _frozen(value: Any) -> Any:
    """A hyperparameter as it is now (a tensor learning rate is copied: schedulers update it in place)."""
    return value.clone() if isinstance(value, torch.Tensor) else value
