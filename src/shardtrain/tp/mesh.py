"""The device mesh of FSDP x tensor parallelism: which dimensions shard the data, which split the layers.

A tensor-parallel mesh has a last dimension named "tp" (the ranks that split each layer) and before
it the data-parallel dimensions: ("dp", "tp") shards parameters over "dp"; ("replicate", "shard",
"tp") is hybrid sharding (sharded over "shard", replicated over "replicate"). The names are torch's
and torchtitan's, so a mesh built for `parallelize_module` + FSDP2 works here unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

TP = "tp"
FLAT_NAMES = ("dp", TP)
HYBRID_NAMES = ("replicate", "shard", TP)


@dataclass(frozen=True, kw_only=True)
class MeshDims:
    """A tensor-parallel mesh and the roles of its dimensions."""

    mesh: DeviceMesh  # the whole mesh: the optimizer's DTensors live on it
    shard: str  # the dimension parameters are sharded over
    replicate: str | None  # hybrid: the dimension the shards are replicated over

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh[TP]

    @property
    def tp_size(self) -> int:
        return self.mesh.size(tuple(self.mesh.mesh_dim_names or ()).index(TP))

    @property
    def hybrid(self) -> bool:
        return self.replicate is not None


def check_tp_divides(*, tp: int, world_size: int, spelled: str) -> None:
    """The world must split into whole tp groups (data-parallel ranks = world / tp); `spelled` is the
    option as the caller's user wrote it (`Engine(tp=2)`, `engine.tp=2`, `tp=2`)."""
    if world_size % tp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"{spelled} with {world_size} processes: the world must be a multiple of tp "
            f"(data-parallel ranks = world / tp); use tp in {divisors}"
        )


def is_tensor_parallel_mesh(mesh: object) -> bool:
    """Whether `mesh` is a DeviceMesh with a dimension named "tp"."""
    return isinstance(mesh, DeviceMesh) and TP in (mesh.mesh_dim_names or ())


def mesh_dims(mesh: DeviceMesh, *, hybrid: bool) -> MeshDims:
    """The roles of a tensor-parallel `mesh`'s dimensions; `hybrid`: the strategy replicates shards."""
    names = tuple(mesh.mesh_dim_names or ())
    expected = HYBRID_NAMES if hybrid else FLAT_NAMES
    if names != expected:
        raise ValueError(
            f"a tensor-parallel mesh with dimensions {names} under a {'hybrid' if hybrid else 'non-hybrid'} "
            f"strategy: build it with mesh_dim_names={expected} "
            f"(init_device_mesh(device, {tuple('n' for _ in expected)}, mesh_dim_names={expected}))"
        )
    return MeshDims(mesh=mesh, shard=names[-2], replicate=names[0] if hybrid else None)
