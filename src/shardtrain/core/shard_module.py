"""`st.shard`: turn a module into a fully sharded one, in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from ..options import ShardOptions
from ..tp.refusals import refuse_offload
from ..tp.tensor_parallel import local_tensors, prepare_tensor_parallel
from . import rebind_optimizers
from .comm import UnitComm
from .flat_buffers import FlatBuffers
from .gathered import GatheredUnit
from .lookup import LookupUnit, runs_sharded_lookup
from .materialize import Materializer, current_tensors, cut_shards
from .param_layout import layout_of_unit
from .partition import Occurrence, Partition, UnitSpec, matching_paths, partition
from .process_groups import control_group, order_group, resolve_device, resolve_groups, tp_norm_group
from .recompute import apply_activation_checkpointing
from .runtime import Runtime
from .sharded_param import ParamFactory
from .unit import HostBuffers, ShardUnit, UnitBehaviour

RUNTIME_ATTR = "_shardtrain_runtime"


def shard_module(model: nn.Module, options: ShardOptions, *, host_buffers: Callable[[], HostBuffers]) -> nn.Module:
    """Shard `model` in place with every option resolved (`options.resolve_options`, called by the public
    `st.shard` in shardtrain/sharding.py): partition into units, materialise and cut each unit, build
    its buffers and the parameters the optimizer sees, install the runtime's hooks. A mesh with a "tp"
    dimension first splits the model over it (`options.tp_plan`, or a model already through
    `parallelize_module`), then shards each TP-local tensor over the data-parallel dimension
    (tp/tensor_parallel.py).

    With `options.offload` on a GPU, the offloaded units' shards and gradients live in host memory
    from `host_buffers()`, called once if any unit is offloaded (the offload package, offload/attach.py,
    passes its page-locked buffers, then attaches its host step to the runtime)."""
    strategy, precision, prefetch = options.strategy, options.precision, options.prefetch
    process_group, param_init_fn = options.process_group, options.param_init_fn
    device = resolve_device(options.device)
    # Note: on a CPU device everything already lives in host memory.
    offload = options.offload if device.type == "cuda" else None
    tp = prepare_tensor_parallel(
        model,
        mesh=options.mesh,
        plan=options.tp_plan,
        strategy=strategy,
        process_group=process_group,
        norm_group=tp_norm_group,
    )
    if tp is not None and options.sync_module_states:
        raise ValueError("sync_module_states with a tensor-parallel mesh: build the model identically on every rank")
    if tp is not None:
        refuse_offload(offload, spelled="st.shard with a tensor-parallel mesh", given=offload)
    groups = resolve_groups(strategy, process_group=process_group, mesh=options.mesh, device=device)
    comm = UnitComm(shard=groups.shard, replicate=groups.replicate, device=device, gather=options.gather)
    factory = ParamFactory(mesh=groups.mesh, tp=tp)

    plan = partition(model, options.wrap)
    offloaded = offload.select(s.numel for s in plan.units) if offload else [False] * len(plan.units)
    ac_paths = (
        matching_paths(model, options.activation_checkpointing, what="activation_checkpointing")
        if options.activation_checkpointing is not None
        else set()
    )
    modules = dict(model.named_modules())
    apply_activation_checkpointing(model, [modules[p] if p else model for p in sorted(ac_paths)])

    runtime = Runtime(
        strategy=strategy,
        comm=comm,
        prefetch=prefetch,
        cast_inputs_to=precision.param_dtype if precision.cast_forward_inputs else None,
        control_group=control_group(process_group),
        order_group=order_group(process_group, check=options.check_order),
        pinned=host_buffers() if any(offloaded) else None,
    )
    materialize_unit = _unit_materializer(model, plan, device=device, param_init_fn=param_init_fn)
    broadcast_group = (process_group or dist.group.WORLD) if options.sync_module_states else None
    for index, spec in enumerate(plan.units):
        originals = list(spec.params)
        materialize_unit(spec)
        tensors = current_tensors(spec) if tp is None else local_tensors(current_tensors(spec))
        layout = layout_of_unit(
            [(occ[0].fqn, tuple(o.fqn for o in occ[1:]), t) for occ, t in zip(spec.occurrences, tensors)],
            world=comm.shard_world,
            precision=precision,
        )
        behaviour = UnitBehaviour(
            # Note: the root too: holding it would add its whole size to the activation peak, while
            # re-gathering it in backward is one more gather of the root's own parameters.
            reshard_after_forward=(
                offload.reshards_after_forward(strategy_reshards=strategy.reshard_after_forward)
                if offload and offloaded[index]
                else strategy.reshard_after_forward
            ),
            resident=strategy.keeps_params_resident,
            reduce_dtype=precision.reduce_dtype,
            offload=offloaded[index],
        )
        shards = cut_shards(layout, tensors, rank=comm.shard_rank, device=device, broadcast_group=broadcast_group)
        if behaviour.offload and runtime.pinned is not None:
            shards = [runtime.pinned.empty(s.shape, s.dtype).copy_(s) for s in shards]
        buffers = [
            FlatBuffers(
                group=group,
                members=[layout.params[i] for i in group.members],
                shard=s,
                device=device,
                rank=comm.shard_rank,
                world=comm.shard_world,
                offload=behaviour.offload,
            )
            for group, s in zip(layout.groups, shards)
        ]
        common = dict(
            index=index,
            name=spec.name,
            layout=layout,
            buffers=buffers,
            comm=comm,
            behaviour=behaviour,
            runtime=runtime,
            factory=factory,
        )
        unit: ShardUnit
        if runs_sharded_lookup(spec, world=comm.shard_world, behaviour=behaviour) and not (
            tp and tp.splits_any(layout.params)
        ):
            unit = LookupUnit(module=cast(nn.Embedding, spec.module), **common)
        else:
            unit = GatheredUnit(installs=_installs(spec.occurrences), **common)
        _register_params(spec.occurrences, unit.params)
        for old, new, s in zip(originals, unit.params, layout.params):
            rebind_optimizers.record(old, new, s.fqn)
        runtime.register(unit, spec.module)
    _place_buffers(model, device, precision.buffer_dtype, broadcast_group)
    setattr(model, RUNTIME_ATTR, runtime)
    return model


def _unit_materializer(
    model: nn.Module, plan: Partition, *, device: torch.device, param_init_fn: Callable[[nn.Module], None] | None
) -> Callable[[UnitSpec], None]:
    """A function that materialises one unit of `plan` (its modules that no nested unit claims, and the
    modules its parameters are registered in)."""
    occurrences = {id(p): occ for spec in plan.units for p, occ in zip(spec.params, spec.occurrences)}
    materializer = Materializer(root=model, device=device, param_init_fn=param_init_fn, occurrences=occurrences)
    unit_modules = {id(spec.module) for spec in plan.units}

    def materialize_unit(spec: UnitSpec) -> None:
        materializer.materialize(
            _scope_modules(spec, unit_modules) + [o.module for occ in spec.occurrences for o in occ]
        )

    return materialize_unit


def _scope_modules(spec: UnitSpec, unit_modules: set[int]) -> list[nn.Module]:
    """Modules of the unit's subtree that no nested unit claims."""
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        out.append(module)
        for child in module.children():
            if id(child) not in unit_modules:
                visit(child)

    visit(spec.module)
    return out


def _installs(occurrences: list[list[Occurrence]]) -> list[tuple[dict, str, int]]:
    return [(o.module.__dict__, o.attr, i) for i, occ in enumerate(occurrences) for o in occ]


def _register_params(occurrences: list[list[Occurrence]], params: list[nn.Parameter]) -> None:
    for occ, p in zip(occurrences, params):
        for o in occ:
            o.module._parameters[o.attr] = p


def _place_buffers(
    model: nn.Module, device: torch.device, buffer_dtype: torch.dtype | None, broadcast_group: dist.ProcessGroup | None
) -> None:
    paths = {id(m): path for path, m in model.named_modules()}
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            if buf.is_meta:
                where = paths.get(id(module)) or "<root>"
                raise ValueError(
                    f"buffer {name!r} of {type(module).__name__} at '{where}' is still on the meta device; "
                    "give the module a reset_parameters() that fills it, or pass param_init_fn"
                )
            new = buf.to(device)
            if buffer_dtype is not None and new.is_floating_point():
                new = new.to(buffer_dtype)
            if broadcast_group is not None:
                dist.broadcast(new, src=dist.get_global_rank(broadcast_group, 0), group=broadcast_group)
            module._buffers[name] = new


def runtime_of(model: nn.Module, *, settle: bool = True) -> Runtime:
    """The runtime of the sharded `model`; `settle`: its deferred optimizer steps completed first.

    Note: every shardtrain API that reads or replaces shards or optimizer state (checkpoints,
    `full_state_dict`, export, clipping) comes through here, so none sees a half-stepped model;
    `no_sync`, which only sets a switch before the forward, passes settle=False to keep the overlap.
    """
    runtime = getattr(model, RUNTIME_ATTR, None)
    if runtime is None:
        raise ValueError(f"{type(model).__name__} is not sharded; call st.shard(model, ...) first")
    if settle:
        runtime.settle()
    return runtime
