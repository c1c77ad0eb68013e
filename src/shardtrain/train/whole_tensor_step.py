"""Exact steps of matrix optimizers over sharded parameters: each parameter stepped as a whole tensor.

The engine's parameters are DTensors holding each rank's rows. AdamW and SGD update each element from
that element alone, so they step the rows as they are; Adafactor (a factored second moment: row and
column means of the squared gradient) and Muon (Newton-Schulz orthogonalization of the update) read
the whole matrix. DTensor computes some of that through collectives, but not all of it (Adafactor's
in-place norm of a partial reduction fails), and where it does the reductions run in another order
than one process's. Here every rank steps each parameter as a whole tensor instead: the parameter, its
gradient and its parameter-shaped state are gathered (DTensor's `full_tensor`), the optimizer's own
`step` runs on them as in one process, and each rank keeps its rows of the result (`distribute_tensor`
with no source rank: a local cut). The update is one process's, bit for bit; the cost is one
parameter's whole tensors at a time and the gathers. State that is not parameter-shaped (Adafactor's
row and column statistics) is whole and the same on every rank, so checkpoints keep it whole (as lists
in the metadata, see `AdafactorWhole`) and it reloads on any world size.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def _whole(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _rows_like(value: Any, param: torch.Tensor) -> Any:
    """`value`, if parameter-shaped, as this rank's rows placed like `param`; otherwise as it is."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() and value.shape == param.shape:
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value


@torch.no_grad()
def step_whole_tensors(optimizer: torch.optim.Optimizer, step: Any) -> None:
    """Run `step` (the optimizer class's own `step`, unbound) on each parameter with a gradient as a
    whole tensor, one parameter at a time, and put the rows back."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            whole = _whole(p.detach())
            whole.grad = _whole(p.grad)
            view = copy.copy(optimizer)
            view.state = {whole: {k: _whole(v) for k, v in optimizer.state.get(p, {}).items()}}
            view.param_groups = [dict(group, params=[whole])]
            step(view)
            if isinstance(p, DTensor):
                p.to_local().copy_(_rows_like(whole, p).to_local())
            optimizer.state[p] = {k: _rows_like(v, p) for k, v in view.state[whole].items()}


class AdafactorWhole(torch.optim.Adafactor):
    """torch's Adafactor, each parameter stepped as a whole tensor (exact over sharded parameters).
    Its row and column statistics are saved as (dtype, list) pairs: checkpoints keep plain values whole."""

    _FACTORS = ("row_var", "col_var")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_state_dict_post_hook(_factors_as_lists)
        self.register_load_state_dict_pre_hook(_factors_as_tensors)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return _closure_then_whole_step(self, torch.optim.Adafactor.step, closure)


class MuonWhole(torch.optim.Muon):
    """torch's Muon, each matrix orthogonalized as a whole tensor (exact over sharded parameters)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return _closure_then_whole_step(self, torch.optim.Muon.step, closure)


def _closure_then_whole_step(optimizer: torch.optim.Optimizer, step: Any, closure: Any) -> Any:
    """torch's `step(closure)` contract: the closure's loss (with gradients on), then `step` on whole tensors."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    step_whole_tensors(optimizer, step)
    return loss


def _factors_as_lists(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    for entry in state_dict["state"].values():
        for key in AdafactorWhole._FACTORS:
            if isinstance(entry.get(key), torch.Tensor):
                value = entry[key]
                entry[key] = (str(value.dtype).removeprefix("torch."), list(value.shape), value.flatten().tolist())
    return state_dict


def _factors_as_tensors(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    for entry in state_dict["state"].values():
        for key in AdafactorWhole._FACTORS:
            if isinstance(entry.get(key), (tuple, list)):
                dtype, shape, values = entry[key]
                entry[key] = torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)
    return state_dict
