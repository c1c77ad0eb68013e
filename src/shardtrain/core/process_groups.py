"""Resolve the device, the process groups a model is sharded over, and the mesh its DTensors live on."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..strategy import Strategy
from ..tp.mesh import MeshDims, is_tensor_parallel_mesh, mesh_dims


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """The compute device: `device`, else this rank's GPU (LOCAL_RANK), else the CPU."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        return torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device; use 'cuda', 'cuda:N', 'cpu' or a torch.device") from exc
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={str(device)!r} but this process sees no CUDA device; use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= count:
            raise ValueError(
                f"device={str(device)!r} but this process sees {count} CUDA device(s) "
                f"(cuda:0 to cuda:{count - 1}); pick one of them, or leave device unset for LOCAL_RANK's"
            )
    elif device.type != "cpu":
        raise ValueError(f"device={str(device)!r}: shardtrain runs on 'cuda' or 'cpu'")
    return device


def require_process_group() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "st.shard needs an initialised process group: call torch.distributed.init_process_group(...) "
            "first (torchrun sets the environment), or let st.Engine(...).launch() do it"
        )


@dataclass(frozen=True, kw_only=True)
class DataParallelGroups:
    """The groups a model is sharded over (None: a group of one) and the mesh its DTensors live on
    (None when nothing is cut: no_shard keeps plain parameters)."""

    shard: dist.ProcessGroup | None
    replicate: dist.ProcessGroup | None
    mesh: DeviceMesh | None


def default_group(process_group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """`process_group`, else the default group (st.shard required one: `require_process_group`)."""
    group = process_group or dist.group.WORLD
    assert group is not None, "no default process group: st.shard calls require_process_group() first"
    return group


def resolve_groups(strategy: Strategy, *, process_group, mesh, device: torch.device) -> DataParallelGroups:
    world_group = default_group(process_group)
    if is_tensor_parallel_mesh(mesh):  # FSDP x TP: shard over the data-parallel dimension (tp/tensor_parallel.py)
        dims = mesh_dims(mesh, hybrid=strategy.is_hybrid)
        replicate = mesh.get_group(dims.replicate) if dims.hybrid else None
        return DataParallelGroups(shard=mesh.get_group(dims.shard), replicate=replicate, mesh=mesh)
    if strategy is Strategy.NO_SHARD:
        if mesh is not None:
            raise ValueError(f"mesh={mesh!r} is only used by hybrid_shard; drop it or use strategy='hybrid_shard'")
        return DataParallelGroups(shard=None, replicate=world_group, mesh=None)
    if not strategy.is_hybrid:
        if mesh is not None:
            raise ValueError(f"mesh={mesh!r} is only used by hybrid_shard; drop it or use strategy='hybrid_shard'")
        return DataParallelGroups(
            shard=world_group, replicate=None, mesh=DeviceMesh.from_group(world_group, device.type)
        )
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 2:
            raise ValueError(f"hybrid_shard needs a 2-D DeviceMesh (replicate, shard), got {mesh.ndim}-D")
        return DataParallelGroups(shard=mesh.get_group(1), replicate=mesh.get_group(0), mesh=mesh)
    return derived(world_group, ("hybrid", mesh, device.type), lambda: _hybrid_groups(world_group, mesh, device))


def _hybrid_groups(world_group, mesh, device: torch.device) -> DataParallelGroups:
    world = dist.get_world_size(world_group)
    if mesh is None:
        shard_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        mesh = (world // shard_size, shard_size)
    if not (isinstance(mesh, tuple) and len(mesh) == 2 and all(isinstance(x, int) and x > 0 for x in mesh)):
        raise ValueError(f"mesh={mesh!r}: use (replicate_size, shard_size) or a 2-D DeviceMesh")
    replicate_size, shard_size = mesh
    if replicate_size * shard_size != world:
        raise ValueError(
            f"mesh={mesh!r}: replicate_size * shard_size = {replicate_size * shard_size} "
            f"must equal the world size {world}"
        )
    ranks = dist.get_process_group_ranks(world_group)
    my = dist.get_rank()
    shard_group = replicate_group = None
    # Note: every rank must create every subgroup, in the same order.
    for r in range(replicate_size):
        members = ranks[r * shard_size : (r + 1) * shard_size]
        group = subgroup(members, parent=world_group)
        if my in members:
            shard_group = group
    for s in range(shard_size):
        members = ranks[s::shard_size]
        group = subgroup(members, parent=world_group)
        if my in members:
            replicate_group = group
    assert shard_group is not None and replicate_group is not None, f"rank {my} is not in {ranks}"
    # Rank (i, j) of the mesh is replica i's j-th shard rank: this rank's row is its shard group.
    grid = torch.tensor(ranks, dtype=torch.int64).view(replicate_size, shard_size)
    device_mesh = DeviceMesh.from_group(
        [replicate_group, shard_group], device.type, mesh=grid, mesh_dim_names=("replicate", "shard")
    )
    return DataParallelGroups(shard=shard_group, replicate=replicate_group, mesh=device_mesh)


def order_group(process_group, *, check: bool) -> dist.ProcessGroup | None:
    """A Gloo group of its own for the order check (core/order_check.py); None when there is nothing to
    compare (one rank) or the check is turned off (`check` False: the options' `check_order`)."""
    group = default_group(process_group)
    if dist.get_world_size(group) == 1 or not check:
        return None
    return derived(group, "order", lambda: subgroup(dist.get_process_group_ranks(group), parent=group, backend="gloo"))


def control_group(process_group) -> dist.ProcessGroup | None:
    """A Gloo group over the same ranks, for small host-side agreements that must not sync the GPU."""
    group = default_group(process_group)
    if dist.get_backend(group) == "gloo":
        return group
    return derived(
        group, "control", lambda: subgroup(dist.get_process_group_ranks(group), parent=group, backend="gloo")
    )


# Groups made from a parent group, per parent (weakly: they go when the parent is destroyed).
_DERIVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def derived(parent: dist.ProcessGroup, key, make: Callable[[], object]):
    """`make()` the first time `key` is asked of `parent`, the same object afterwards.

    Note: a process group lives until the job destroys every group: one made per `st.shard` call
    would keep its connections and threads (three per Gloo group) for as long, and a process that
    shards many models (a sweep, a test suite) would pile them up. Every rank shards the same models
    in the same order, so every rank asks the same keys and makes the same groups.
    """
    mine = _DERIVED.setdefault(parent, {})
    if key not in mine:
        mine[key] = make()
    return mine[key]


def subgroup(ranks: list[int], *, parent: dist.ProcessGroup, backend: str | None = None) -> dist.ProcessGroup:
    """A new group of `ranks` with `parent`'s collective timeout.

    Note: `dist.new_group` gives a group torch's default timeout (30 minutes), not the one the job was
    started with (`init_process_group(timeout=...)`, `--engine.timeout`); a rank that stopped arriving
    would then hang its peers in the subgroup's collectives for half an hour.
    """
    return dist.new_group(ranks, backend=backend, timeout=group_timeout(parent))


def group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The collective timeout `group` was created with (None: unknown, torch's default applies)."""
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError, TypeError):  # no backend for this device type
            continue
    return None


def tp_norm_group(dims: MeshDims) -> dist.ProcessGroup:
    """The ranks that together hold every element once under tensor parallelism: the shard and tp
    dimensions (one group per replica under hybrid sharding; replicas hold identical shards)."""
    grid = dims.mesh.mesh
    rows = [tuple(r.flatten().tolist()) for r in grid] if dims.hybrid else [tuple(grid.flatten().tolist())]
    world = default_group()
    if rows == [tuple(range(dist.get_world_size()))]:
        return world
    me = dist.get_rank()

    def make() -> dist.ProcessGroup:
        groups = [subgroup(list(r), parent=world) for r in rows]  # every rank makes every group, in order
        return next(g for g, r in zip(groups, rows) if me in r)

    return derived(world, ("tp-norm", tuple(rows)), make)
