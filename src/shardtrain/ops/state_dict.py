"""Full (unsharded) state dicts of a sharded model, built and loaded one unit at a time."""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from ..core.collectives import all_gather_tensor
from ..core.held import held_params
from ..core.partition import clean_name
from ..core.shard_module import runtime_of
from ..core.unit import ShardUnit


def gather_params(unit: ShardUnit, local: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Each parameter of `unit` whole, from every rank of the shard group (all of them take part).

    `local` gives, per parameter, this rank's real rows of a tensor laid out like it (an optimizer
    state, say); by default the parameters themselves. One all-gather per flat group, then, under
    tensor parallelism, one over "tp" per split parameter (the global tensor, as the unsharded model has it).
    """
    local = [unit.held(i) for i in range(len(unit.layout.params))] if local is None else local
    out: list[torch.Tensor | None] = [None] * len(local)
    for buf in unit.buffers:
        members = [unit.layout.params[i] for i in buf.group.members]
        if buf.world == 1:
            for i in buf.group.members:
                out[i] = local[i]
            continue
        dtype = local[buf.group.members[0]].dtype
        chunk = torch.zeros(buf.group.shard_numel, dtype=dtype, device=unit.device)
        for i, start in zip(buf.group.members, buf.group.shard_offsets):
            rows = local[i].reshape(-1)
            chunk[start : start + rows.numel()].copy_(rows)
        every = torch.empty(buf.world * buf.group.shard_numel, dtype=dtype, device=unit.device)
        all_gather_tensor(every, chunk, group=unit.comm.shard)
        by_rank = every.view(buf.world, buf.group.shard_numel)
        for i, m, start in zip(buf.group.members, members, buf.group.shard_offsets):
            whole = by_rank[:, start : start + m.local_numel].reshape(m.padded_rows, *m.shape[1:])
            out[i] = whole[: m.rows]
    gathered = cast("list[torch.Tensor]", out)  # every group's members cover every parameter
    tp = unit.factory.tp
    return gathered if tp is None else tp.full_tensors(gathered, unit.layout.params)


def named_tensors(unit: ShardUnit, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (one per parameter of `unit`) under every name of each parameter (aliases share it)."""
    out = {}
    for shard, tensor in zip(unit.layout.params, tensors):
        for name in (shard.fqn, *shard.aliases):
            out[name] = tensor
    return out


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu: bool = True) -> dict[str, torch.Tensor]:
    """Original names, full tensors (on CPU by default), on rank 0 (every rank with rank0_only=False).

    Keys and order match the unsharded model's `state_dict()`, so `plain.load_state_dict(sd)` works;
    names carry no `_orig_mod.` (torch.compile) or `_checkpoint_wrapped_module.` segments (`clean_name`).
    """
    runtime = runtime_of(model)
    keep = not rank0_only or dist.get_rank() == 0
    params: dict[str, torch.Tensor] = {}
    for unit in runtime.units:
        whole = gather_params(unit)
        if keep:
            params.update(named_tensors(unit, [t.detach().to("cpu", copy=True) if cpu else t.clone() for t in whole]))
    if not keep:
        return {}
    out = {}
    for raw, value in model.state_dict(keep_vars=True).items():
        name = clean_name(raw)
        if name in params:
            out[name] = params[name]
        else:
            value = value.detach()
            out[name] = value.cpu() if cpu else value.clone()
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy full tensors (present on every rank) into the shards and buffers of a sharded model.

    A missing, unexpected or mis-shaped entry (parameter or buffer) is a ValueError naming it; with
    `strict=False` the matching entries load and the others are left as they are."""
    runtime = runtime_of(model)
    expected = {clean_name(k) for k in model.state_dict()}
    missing = sorted(expected - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected)
    held = list(held_params(runtime))
    buffers = {clean_name(n): b for n, b in model.named_buffers()}
    shapes = {h.name: h.shape for h in held} | {name: tuple(b.shape) for name, b in buffers.items()}
    fits = {name for name, value in state_dict.items() if shapes.get(name) == tuple(value.shape)}
    mis_shaped = [
        f"{name}: checkpoint {tuple(value.shape)} vs model {shapes[name]}"
        for name, value in state_dict.items()
        if name in shapes and name not in fits
    ]
    if strict and (missing or unexpected or mis_shaped):
        raise ValueError(
            f"state dict does not match the model: missing {missing}, unexpected {unexpected}, "
            f"mis-shaped {mis_shaped}; pass strict=False to load the matching part"
        )
    with torch.no_grad():
        for h in held:
            if h.name not in fits:
                continue
            value = state_dict[h.name]
            h.local.copy_(h.box.cut(value) if h.shape else value)
        for name, buffer in buffers.items():
            if name in fits:  # a mis-shaped value would broadcast into the buffer silently
                buffer.copy_(state_dict[name])
