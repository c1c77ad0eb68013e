"""`st.shard`: turn a module into a sharded one, in place."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..planning.units import Occurrence, UnitSpec, matching_paths, partition
from ..policy import AutoPolicy, is_auto, parse_cpu_offload, parse_mixed_precision
from ..strategy import Strategy, parse_strategy
from .comm import Groups
from .flat import build_layout
from .groups import control_group, require_process_group, resolve_device, resolve_groups
from .lookup import LookupUnit, runs_sharded_lookup
from .materialize import Materializer, current_tensors, flatten_and_shard
from .pinned import PinnedBuffers
from .recompute import apply_activation_checkpointing
from .runtime import Runtime
from .unit import ShardUnit, UnitBehaviour

RUNTIME_ATTR = "_shardtrain_runtime"


def shard(
    model: nn.Module,
    *,
    strategy: Any = "full_shard",
    wrap: Any = None,
    mixed_precision: Any = None,
    activation_checkpointing: Any = None,
    cpu_offload: Any = False,
    mesh: Any = None,
    device: Any = None,
    process_group: dist.ProcessGroup | None = None,
    forward_prefetch: bool = True,
    backward_prefetch: bool = True,
    limit_all_gathers: bool = True,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    sync_module_states: bool = False,
) -> nn.Module:
    """Shard `model` in place over the data-parallel ranks and return it.

    `model.parameters()` afterwards yields, under the original names, this rank's pieces of the
    fp32 parameters: hand them to any elementwise optimizer. See API.md §1 for every option.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"st.shard expects an nn.Module, got {type(model).__name__}")
    if hasattr(model, RUNTIME_ATTR):
        raise ValueError(f"{type(model).__name__} is already sharded; call st.shard once per model")
    require_process_group()
    if is_auto(strategy):
        strategy, activation_checkpointing, cpu_offload = _resolve_auto(
            model, strategy, wrap=wrap, mixed_precision=mixed_precision, process_group=process_group)
    strategy = parse_strategy(strategy)
    precision = parse_mixed_precision(mixed_precision)
    device = resolve_device(device)
    # Note: on a CPU device everything already lives in host memory; offload changes nothing there.
    offload_policy = parse_cpu_offload(cpu_offload) if device.type == "cuda" else None
    if offload_policy and (offload_policy.threads or torch.get_num_threads() < offload_policy.host_threads()):
        # Note: the optimizer steps the offloaded shards with torch's intra-op threads; one thread
        # per process (torchrun's default) made the host AdamW most of the step at 8B.
        torch.set_num_threads(offload_policy.host_threads())
    shard_group, replicate_group = resolve_groups(strategy, process_group=process_group, mesh=mesh)
    groups = Groups(shard=shard_group, replicate=replicate_group, device=device)

    plan = partition(model, wrap)
    offloaded = offload_policy.select(spec.numel for spec in plan.units) if offload_policy else [False] * len(plan.units)
    ac_paths = matching_paths(model, activation_checkpointing, what="activation_checkpointing") \
        if activation_checkpointing is not None else set()
    modules = dict(model.named_modules())
    apply_activation_checkpointing([modules[p] if p else model for p in sorted(ac_paths)])

    runtime = Runtime(
        strategy=strategy,
        groups=groups,
        forward_prefetch=forward_prefetch,
        backward_prefetch=backward_prefetch,
        prefetch_depth=1 if limit_all_gathers else 2,
        cast_inputs_to=precision.param_dtype if precision.cast_forward_inputs else None,
        control_group=control_group(process_group),
        pinned=PinnedBuffers() if any(offloaded) else None,
    )
    occurrences = {id(p): occ for spec in plan.units for p, occ in zip(spec.params, spec.occurrences)}
    materializer = Materializer(device=device, param_init_fn=param_init_fn, occurrences=occurrences)
    unit_modules = {id(spec.module) for spec in plan.units}
    broadcast_group = (process_group or dist.group.WORLD) if sync_module_states else None
    shard_world = groups.shard_world
    for index, spec in enumerate(plan.units):
        scope = _scope_modules(spec, unit_modules)
        materializer.materialize(scope + [o.module for occ in spec.occurrences for o in occ])
        tensors = current_tensors(spec)
        layout = build_layout(
            [(occ[0].fqn, t, tuple(o.fqn for o in occ[1:])) for occ, t in zip(spec.occurrences, tensors)],
            shard_world,
        )
        flat_shard = flatten_and_shard(tensors, layout, device=device, shard_rank=groups.shard_rank,
                                       broadcast_group=broadcast_group)
        offload = offloaded[index]
        if offload:
            flat_shard = runtime.pinned.empty(flat_shard.shape, flat_shard.dtype).copy_(flat_shard)
        behaviour = UnitBehaviour(
            # Note: the root too: re-gathering it at the start of backward cost nothing measurable on
            # 2 x H200 at 1.5B, and holding it would add its whole size to the activation peak.
            reshard_after_forward=strategy.reshard_after_forward,
            resident=strategy.keeps_params_resident,
            param_dtype=precision.param_dtype or flat_shard.dtype,
            reduce_dtype=precision.reduce_dtype or flat_shard.dtype,
            offload=offload,
        )
        installs = _installs(spec.occurrences)
        unit_kwargs = dict(index=index, name=spec.name, layout=layout, shard=flat_shard, installs=installs,
                           groups=groups, behaviour=behaviour, runtime=runtime)
        if runs_sharded_lookup(spec, layout=layout, behaviour=behaviour):
            unit = LookupUnit(module=spec.module, **unit_kwargs)
        else:
            unit = ShardUnit(**unit_kwargs)
        _register_shard_params(spec.occurrences, unit.shard_params)
        runtime.register(unit, spec.module)
    _place_buffers(model, device, precision.buffer_dtype, broadcast_group)
    setattr(model, RUNTIME_ATTR, runtime)
    return model


def _resolve_auto(model: nn.Module, policy: Any, *, wrap: Any, mixed_precision: Any, process_group):
    """strategy="auto": the planner's fastest configuration predicted to fit (planning/auto.py)."""
    from ..planning.auto import resolve_auto

    if not isinstance(policy, AutoPolicy):
        seq_len = getattr(getattr(model, "cfg", None), "max_seq_len", None)
        if seq_len is None:
            raise ValueError("strategy='auto' cannot tell the sequence length of this model; pass "
                             "strategy=st.AutoPolicy(micro_batch=..., seq_len=...) instead")
        policy = AutoPolicy(micro_batch=1, seq_len=seq_len)
    choice = resolve_auto(model, world_size=dist.get_world_size(process_group), micro_batch=policy.micro_batch,
                          seq_len=policy.seq_len, grad_accum=policy.grad_accum, wrap=wrap,
                          device_memory=policy.device_memory, mixed_precision=mixed_precision or "fp32")
    if dist.get_rank() == 0:
        print(choice, flush=True)
    chosen = choice.shard_kwargs(model, wrap=wrap)
    return chosen["strategy"], chosen["activation_checkpointing"], chosen["cpu_offload"]


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


def _register_shard_params(occurrences: list[list[Occurrence]], params: list[nn.Parameter]) -> None:
    for occ, p in zip(occurrences, params):
        for o in occ:
            o.module._parameters[o.attr] = p


def _place_buffers(model: nn.Module, device: torch.device, buffer_dtype: torch.dtype | None,
                   broadcast_group: dist.ProcessGroup | None) -> None:
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            if buf.is_meta:
                raise ValueError(f"buffer {name!r} of {type(module).__name__} is still on the meta device; "
                                 "give the module a reset_parameters() that fills it, or pass param_init_fn")
            new = buf.to(device)
            if buffer_dtype is not None and new.is_floating_point():
                new = new.to(buffer_dtype)
            if broadcast_group is not None:
                dist.broadcast(new, src=dist.get_global_rank(broadcast_group, 0), group=broadcast_group)
            module._buffers[name] = new


def runtime_of(model: nn.Module) -> Runtime:
    runtime = getattr(model, RUNTIME_ATTR, None)
    if runtime is None:
        raise ValueError(f"{type(model).__name__} is not sharded; call st.shard(model, ...) first")
    return runtime
