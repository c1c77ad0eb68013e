"""Tensor parallelism inside the engine (core/shard_module.py builds it): what a unit shards, what the
optimizer sees, what forward uses.

The engine shards a split parameter's TP-local tensor exactly as a plain parameter, so units, buffers
and collectives need not know about tensor parallelism; this module supplies the three places where
they differ: the local tensors the layout is cut from (`local_tensors`), the optimizer-visible
DTensors' specs (tp/placements.py), and the gathered views as DTensors on the "tp" mesh
(`compute_views`). Why each: docs/design.md, Note [Tensor parallelism inside units].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.placement_types import Placement

from ..strategy import Strategy
from .boxes import split_of
from .mesh import MeshDims, is_tensor_parallel_mesh, mesh_dims
from .placements import mesh_placements, replicated_on_tp
from .plans import resolve_plan


class ParamShard(Protocol):
    """What this module reads of a parameter's cut (core/param_layout.py's `ParamShard`)."""

    @property
    def fqn(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True, kw_only=True)
class TpParam:
    """A parameter split by tensor parallelism: its placement on "tp" and its global shape."""

    placement: Placement
    shape: torch.Size
    stride: tuple[int, ...]


class TensorParallel:
    """The split parameters of one model (by every name they are registered under) and its mesh."""

    def __init__(self, *, dims: MeshDims, params: dict[str, TpParam], norm_group: dist.ProcessGroup) -> None:
        self.dims = dims
        self.tp_mesh = dims.tp_mesh
        self.tp_size = dims.tp_size
        self.tp_rank = self.tp_mesh.get_local_rank()
        self.params = params
        self.norm_group = norm_group  # the ranks that together hold every element once
        self._specs: dict[tuple[str, torch.dtype], DTensorSpec] = {}

    def splits_any(self, shards: tuple[ParamShard, ...]) -> bool:
        return any(s.fqn in self.params for s in shards)

    def counts_once(self, shard: ParamShard) -> bool:
        """Whether this rank's rows of `shard` enter a norm: every tp rank holds a replicated parameter
        whole, so only tp rank 0 counts it."""
        tp = self.params.get(shard.fqn)
        return self.tp_rank == 0 or not replicated_on_tp(tp.placement if tp else Replicate())

    def counts_every(self, shards: tuple[ParamShard, ...]) -> bool:
        """Whether this rank's rows of every one of `shards` enter a norm (always on tp rank 0)."""
        return self.tp_rank == 0 or all(self.counts_once(s) for s in shards)

    def spec(self, shard: ParamShard, dtype: torch.dtype) -> DTensorSpec:
        """The spec of the optimizer-visible tensor of `shard` (and of its gradient) on the whole mesh."""
        key = (shard.fqn, dtype)
        spec = self._specs.get(key)
        if spec is None:
            tp = self.params.get(shard.fqn)
            shape = tp.shape if tp else torch.Size(shard.shape)
            stride = tp.stride if tp else torch.empty(shard.shape, device="meta").stride()
            placements = mesh_placements(
                tp.placement if tp else Replicate(),
                tp_size=self.tp_size,
                hybrid=self.dims.hybrid,
                cut=bool(shard.shape),
            )
            spec = DTensorSpec(self.dims.mesh, placements, tensor_meta=TensorMeta(shape, stride, dtype))
            self._specs[key] = spec
        return spec

    def global_shape(self, shard: ParamShard) -> tuple[int, ...]:
        tp = self.params.get(shard.fqn)
        return tuple(tp.shape) if tp else shard.shape

    def split(self, shard: ParamShard) -> str | None:
        """How tensor parallelism splits `shard` ("rows", "cols", or None), for checkpoints (tp/boxes.py)."""
        tp = self.params.get(shard.fqn)
        return split_of(tp.placement) if tp else None

    def full_tensors(self, tensors: list[torch.Tensor], shards: tuple[ParamShard, ...]) -> list[torch.Tensor]:
        """Whole TP-local tensors (gathered over dp) made global: split ones gathered over "tp"."""
        out = []
        for tensor, shard in zip(tensors, shards):
            tp = self.params.get(shard.fqn)
            if tp is not None:
                tensor = DTensor.from_local(
                    tensor.contiguous(),
                    self.tp_mesh,
                    (tp.placement,),
                    run_check=False,
                    shape=tp.shape,
                    stride=tp.stride,
                ).full_tensor()
            out.append(tensor)
        return out

    def compute_views(self, views: tuple[torch.Tensor, ...], shards: tuple[ParamShard, ...]) -> tuple:
        """The gathered TP-local views as forward uses them: split parameters as DTensors on "tp"."""
        if not self.params:
            return views
        out = []
        for view, shard in zip(views, shards):
            tp = self.params.get(shard.fqn)
            if tp is not None:
                view = DTensor.from_local(
                    view, self.tp_mesh, (tp.placement,), run_check=False, shape=tp.shape, stride=tp.stride
                )
            out.append(view)
        return tuple(out)


def local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's TP-local part (a DTensor's local tensor, keeping `requires_grad`), or itself."""
    return [t._local_tensor.detach().requires_grad_(t.requires_grad) if isinstance(t, DTensor) else t for t in tensors]


def prepare_tensor_parallel(
    model: nn.Module,
    *,
    mesh: Any,
    plan: Any,
    strategy: Strategy,
    process_group: dist.ProcessGroup | None,
    norm_group: Callable[[MeshDims], dist.ProcessGroup],
) -> TensorParallel | None:
    """Apply `plan` to `model` over the mesh's "tp" dimension (unless it is of size 1: nothing to split)
    and collect the split parameters; None when `mesh` has no "tp" dimension. `norm_group(dims)` makes
    the process group a norm sums over (core/process_groups.py)."""
    split = {n: p for n, p in model.named_parameters(remove_duplicate=False) if isinstance(p, DTensor)}
    if not is_tensor_parallel_mesh(mesh):
        if plan is not None:
            raise ValueError(
                f"tp_plan given with mesh={mesh!r}: pass a DeviceMesh with dimensions ('dp', 'tp') "
                "(init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')))"
            )
        if split:
            raise ValueError(
                f"parameter {next(iter(split))!r} is a DTensor (the model went through parallelize_module): "
                "pass the whole mesh as st.shard(model, mesh=<DeviceMesh ('dp', 'tp')>)"
            )
        return None
    if strategy is Strategy.NO_SHARD:
        raise ValueError("strategy='no_shard' with a tensor-parallel mesh: use 'full_shard' or 'shard_grad_op'")
    if process_group is not None:
        raise ValueError("process_group with a tensor-parallel mesh: the mesh names the groups; drop process_group")
    dims = mesh_dims(mesh, hybrid=strategy.is_hybrid)
    if plan is not None:
        if split:
            raise ValueError(
                f"tp_plan given but parameter {next(iter(split))!r} is split already (parallelize_module); "
                "pass tp_plan=None"
            )
        plan = resolve_plan(plan)
        if dims.tp_size > 1:
            _check_splittable(model)
            parallelize_module(model, dims.tp_mesh, plan)
            split = {n: p for n, p in model.named_parameters(remove_duplicate=False) if isinstance(p, DTensor)}
            if not split:
                raise ValueError(
                    f"tp_plan split no parameter of {type(model).__name__}: its paths {sorted(plan)[:4]} match no "
                    "module holding parameters; name modules as model.named_modules() does (a peft model "
                    "nests them under 'base_model.model.')"
                )
    params = {}
    for name, p in split.items():
        if p.device_mesh != dims.tp_mesh or len(p.placements) != 1:
            raise ValueError(
                f"parameter {name!r} is a DTensor on {p.device_mesh} {p.placements}; split it over the "
                "mesh's 'tp' dimension only (parallelize_module(model, mesh['tp'], plan))"
            )
        params[name] = TpParam(placement=p.placements[0], shape=p.shape, stride=p.stride())
    return TensorParallel(dims=dims, params=params, norm_group=norm_group(dims))


def _check_splittable(model: nn.Module) -> None:
    """Refuse what parallelize_module would silently get wrong or fail on deep inside: tied parameters,
    peft's adapter layers (their base layer and adapters would need splits of their own)."""
    for name, module in model.named_modules():
        if type(module).__module__.startswith("peft.") and hasattr(module, "base_layer"):
            raise ValueError(
                f"module {name!r} is a peft adapter layer ({type(module).__name__}): tensor parallelism does not "
                "split LoRA adapters yet; train them without a 'tp' mesh dimension (the frozen base sharded over "
                "dp), or merge them into the base (merge_and_unload) before st.shard(..., tp_plan=...)"
            )
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            raise ValueError(
                f"parameters {seen[id(p)]!r} and {name!r} are tied: tensor parallelism splits them differently; "
                "untie them (e.g. tie_embeddings=False) to use tp_plan"
            )
        seen[id(p)] = name
