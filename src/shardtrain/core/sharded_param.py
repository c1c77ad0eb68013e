"""The tensors the optimizer sees: one per original parameter, holding this rank's rows of it.

Where a strategy cuts parameters, each is an `nn.Parameter` wrapping a DTensor (`Shard(0)` on the
shard group's mesh) with the original's shape, name, dtype and `requires_grad`, whose local tensor is
a view of the unit's shard and whose `.grad` views the unit's sharded gradient; no_shard keeps plain
parameters, as DDP does. Why DTensors rather than plain local tensors, and what they cost:
docs/design.md, "Parameters keep their shape".
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..tp.tensor_parallel import TensorParallel
from . import replicated_steps
from .param_layout import ParamShard


class ParamFactory:
    """Makes the optimizer-visible parameter and gradient of each `ParamShard` from local views.

    `mesh` None: plain tensors (no_shard). A one-dimensional mesh is the shard group; a two-dimensional
    one is (replicate, shard). With `tp`, the mesh has a "tp" dimension and `tp` places every tensor.
    """

    def __init__(self, *, mesh: DeviceMesh | None, tp: TensorParallel | None = None) -> None:
        self.mesh = mesh
        self.tp = tp
        self._specs: dict[tuple, DTensorSpec] = {}

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    def _spec(self, shard: ParamShard, dtype: torch.dtype) -> DTensorSpec:
        if self.tp is not None:
            return self.tp.spec(shard, dtype)
        key = (shard.shape, dtype, bool(shard.shape))
        spec = self._specs.get(key)
        if spec is None:
            mesh = self.mesh
            assert mesh is not None, "without a mesh, parameters are plain tensors (wrap)"
            placement = Shard(0) if shard.shape else Replicate()
            placements = (placement,) if mesh.ndim == 1 else (Replicate(), placement)
            stride = torch.empty(shard.shape, device="meta").stride()
            spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shard.shape), stride, dtype))
            self._specs[key] = spec
        return spec

    def wrap(self, local: torch.Tensor, shard: ParamShard) -> torch.Tensor:
        """`local` (this rank's real rows) as the tensor the optimizer sees: a DTensor, or itself."""
        if self.mesh is None:
            return local
        # Note: DTensor's own constructor with a prepared spec, as torch FSDP2 does: from_local() runs
        # an autograd function and checks the arguments, which costs host time once per gradient per step.
        return DTensor(local, self._spec(shard, local.dtype), requires_grad=False)

    def compute_views(self, views: tuple[torch.Tensor, ...], shards: tuple[ParamShard, ...]) -> tuple:
        """The gathered views as forward uses them (TP DTensors for split parameters, else themselves)."""
        return views if self.tp is None else self.tp.compute_views(views, shards)

    def parameter(self, local: torch.Tensor, shard: ParamShard) -> nn.Parameter:
        param = nn.Parameter(self.wrap(local, shard), requires_grad=shard.requires_grad)
        if self.mesh is not None:
            replicated_steps.track(param)  # a fused optimizer's step count of it becomes a DTensor
        return param


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of an optimizer-visible tensor (a DTensor's local tensor, or the tensor)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
