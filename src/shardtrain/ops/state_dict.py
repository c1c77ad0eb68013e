"""Full (unsharded) state dicts of a sharded model, built and loaded one unit at a time."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..core.comm import _all_gather
from ..core.shard import runtime_of
from ..core.unit import ShardUnit


def gather_unit(unit: ShardUnit, flat: torch.Tensor | None = None) -> torch.Tensor:
    """The full padded flat tensor of `flat` (default: the unit's parameter shard), laid out like the
    unit's shard, from every rank of the shard group (all of them take part)."""
    flat = unit.shard if flat is None else flat
    if unit.layout.shard_world == 1:
        return flat
    # Note: an offloaded shard lives on the host; the collective runs on the compute device.
    full = torch.empty(unit.layout.padded_numel, dtype=flat.dtype, device=unit.device)
    _all_gather(full, flat.to(unit.device), group=unit.groups.shard)
    return full


def unit_tensors(unit: ShardUnit, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """Split a unit's full flat parameter into its named parameters (aliases share the tensor)."""
    out = {}
    for slot in unit.layout.slots:
        t = full[slot.offset:slot.end].view(slot.shape)
        for name in (slot.fqn, *slot.aliases):
            out[name] = t
    return out


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu: bool = True) -> dict[str, torch.Tensor]:
    """Original names, full tensors (on CPU by default), on rank 0 (every rank with rank0_only=False).

    Keys and order match the unsharded model's `state_dict()`, so `plain.load_state_dict(sd)` works.
    """
    runtime = runtime_of(model)
    keep = not rank0_only or dist.get_rank() == 0
    params: dict[str, torch.Tensor] = {}
    for unit in runtime.units:
        full = gather_unit(unit)
        if keep:
            if cpu:
                full = full.cpu()
            elif full is unit.shard:
                full = full.clone()
            params.update(unit_tensors(unit, full))
    if not keep:
        return {}
    out = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if name in params:
            out[name] = params[name]
        else:
            value = value.detach()
            out[name] = value.cpu() if cpu else value.clone()
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy full tensors (present on every rank) into the shards and buffers of a sharded model."""
    runtime = runtime_of(model)
    expected = set(model.state_dict().keys())
    missing = sorted(expected - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected)
    mis_shaped = []
    for unit in runtime.units:
        for slot in unit.layout.slots:
            value = state_dict.get(slot.fqn)
            if value is not None and tuple(value.shape) != slot.shape:
                mis_shaped.append(f"{slot.fqn}: checkpoint {tuple(value.shape)} vs model {slot.shape}")
    if strict and (missing or unexpected or mis_shaped):
        raise ValueError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}, "
                         f"mis-shaped {mis_shaped}; pass strict=False to load the matching part")
    with torch.no_grad():
        for unit in runtime.units:
            rank = unit.groups.shard_rank if unit.layout.shard_world > 1 else 0
            for slot, param in zip(unit.layout.slots, unit.shard_params):
                value = state_dict.get(slot.fqn)
                if value is None or tuple(value.shape) != slot.shape:
                    continue
                if unit.layout.shard_world == 1:
                    param.copy_(value)
                    continue
                piece = unit.layout.local_piece(slot, rank)
                param.copy_(value.reshape(-1)[piece.param_start:piece.param_start + piece.numel])
        buffers = {n: b for n, b in model.named_buffers()}
        for name, value in state_dict.items():
            if name in buffers:
                buffers[name].copy_(value)
