"""Resolve the device and the process groups a model is sharded over."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..strategy import Strategy


def resolve_device(device) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def require_process_group() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "st.shard needs an initialised process group: call torch.distributed.init_process_group(...) "
            "first (torchrun sets the environment), or let st.Engine(...).launch() do it"
        )


def resolve_groups(strategy: Strategy, *, process_group, mesh) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Return (shard group, replicate group); None means a group of one."""
    world_group = process_group or dist.group.WORLD
    if strategy is Strategy.NO_SHARD:
        return None, world_group
    if not strategy.is_hybrid:
        if mesh is not None:
            raise ValueError(f"mesh={mesh!r} is only used by hybrid_shard; drop it or use strategy='hybrid_shard'")
        return world_group, None
    return _hybrid_groups(world_group, mesh)


def _hybrid_groups(world_group, mesh):
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 2:
            raise ValueError(f"hybrid_shard needs a 2-D DeviceMesh (replicate, shard), got {mesh.ndim}-D")
        return mesh.get_group(1), mesh.get_group(0)
    world = dist.get_world_size(world_group)
    if mesh is None:
        shard_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        mesh = (world // shard_size, shard_size)
    if not (isinstance(mesh, tuple) and len(mesh) == 2 and all(isinstance(x, int) and x > 0 for x in mesh)):
        raise ValueError(f"mesh={mesh!r}: use (replicate_size, shard_size) or a 2-D DeviceMesh")
    replicate_size, shard_size = mesh
    if replicate_size * shard_size != world:
        raise ValueError(f"mesh={mesh!r}: replicate_size * shard_size = {replicate_size * shard_size} "
                         f"must equal the world size {world}")
    ranks = dist.get_process_group_ranks(world_group)
    my = dist.get_rank()
    shard_group = replicate_group = None
    # Note: every rank must create every subgroup, in the same order.
    for r in range(replicate_size):
        members = ranks[r * shard_size:(r + 1) * shard_size]
        group = dist.new_group(members)
        if my in members:
            shard_group = group
    for s in range(shard_size):
        members = ranks[s::shard_size]
        group = dist.new_group(members)
        if my in members:
            replicate_group = group
    return shard_group, replicate_group


def control_group(process_group) -> dist.ProcessGroup | None:
    """A Gloo group over the same ranks, for small host-side agreements that must not sync the GPU."""
    group = process_group or dist.group.WORLD
    if dist.get_backend(group) == "gloo":
        return group
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
