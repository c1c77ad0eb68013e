"""`st.shard`: turn a module into a fully sharded one, in place."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..compat import translate_policy_objects, translate_torch_options
from ..policy import (AutoPolicy, CPUOffload, MixedPrecision, WrapPolicy, is_auto, parse_cpu_offload,
                      parse_mixed_precision)
from ..strategy import Strategy, parse_strategy
from . import replaced
from .comm import UnitComm
from .flat_buffers import FlatBuffers
from .gathered import GatheredUnit
from .layout import layout_of_unit
from .lookup import LookupUnit, runs_sharded_lookup
from .materialize import Materializer, current_tensors, cut_shards
from .partition import Occurrence, UnitSpec, matching_paths, partition
from .pinned import PinnedBuffers
from .process_groups import control_group, order_group, require_process_group, resolve_device, resolve_groups
from .recompute import apply_activation_checkpointing
from .runtime import Runtime
from .sharded_param import ParamFactory
from .unit import ShardUnit, UnitBehaviour

RUNTIME_ATTR = "_shardtrain_runtime"


def shard(
    model: nn.Module,
    *,
    strategy: Strategy | str | AutoPolicy = "full_shard",
    wrap: WrapPolicy | None = None,
    mixed_precision: MixedPrecision | str | None = None,
    activation_checkpointing: WrapPolicy | None = None,
    cpu_offload: CPUOffload | bool | float = False,
    mesh: DeviceMesh | tuple[int, int] | None = None,
    device: torch.device | str | int | None = None,
    process_group: dist.ProcessGroup | None = None,
    prefetch: int = 1,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    sync_module_states: bool = False,
    **torch_options: Any,
) -> nn.Module:
    """Shard `model` in place over the data-parallel ranks and return it.

    Every parameter is cut along its first dimension: each rank of the shard group keeps its rows of
    every parameter (fp32 master weights, gradients and the optimizer's state), gathers a unit's
    parameters just before the unit computes, frees them after, and reduce-scatters their gradients,
    overlapping the communication with compute.

    Afterwards `model.parameters()` yields, under the original names and in the original order, one
    `nn.Parameter` per original parameter: a DTensor placed `Shard(0)` on the shard group's mesh
    (plain full tensors under no_shard). Its shape, `dim()`, `numel()`, dtype and `requires_grad` are
    the original's, so build any torch optimizer from it, with parameter groups chosen by name or by
    shape; `to_local()` is this rank's rows. Frozen parameters get no gradient storage and no
    communication. `model.state_dict()` holds these DTensors; `st.full_state_dict` gathers full tensors.

    Args (keyword-only):
        strategy: "full_shard" (ZeRO-3), "shard_grad_op" (ZeRO-2: parameters kept gathered from forward
            to backward), "optimizer_only" (ZeRO-1: parameters resident, gradients and optimizer state
            sharded), "no_shard" (DDP), "hybrid_shard" / "hybrid_shard_zero2" (sharded inside groups
            of `mesh`, replicated across them), or "auto" / `st.AutoPolicy(...)` (the fastest setup the
            memory estimator predicts to fit). torch's names (`ShardingStrategy` members, "FULL_SHARD")
            are accepted.
        wrap: which modules become units: a set of module classes, `st.SizePolicy(min_params=...)`, or
            a callable(module) -> bool. The root is always a unit; each parameter belongs to the
            innermost unit holding it; a parameter tied across units moves to their common ancestor.
            `st.plan(model, wrap=...)` prints the units without a process group.
        mixed_precision: "bf16", "fp16" (with `st.GradScaler`), "fp32", or `st.MixedPrecision(...)`.
            Trainable parameters keep an fp32 master whatever dtype the model was built in; frozen
            parameters keep their dtype. Units may mix dtypes.
        activation_checkpointing: modules (a policy like `wrap`) whose activations are recomputed in
            backward.
        cpu_offload: True, a share of the parameters such as 0.5 (whole units, in plan order), or
            `st.CPUOffload(...)`: shards, gradients and optimizer state live in pinned host memory and
            the optimizer steps them on the CPU. Ignored on a CPU device.
        mesh: hybrid only: (replicate_size, shard_size) or a 2-D DeviceMesh (default: one shard group
            per node).
        device: the compute device (default: this rank's GPU, LOCAL_RANK, else the CPU).
        process_group: the data-parallel ranks (default: the world).
        prefetch: units gathered ahead of the one computing, in forward and in backward (0: none).
        param_init_fn: initialises each module of a model built on the meta device (default: the
            Hugging Face model's `_init_weights`, else `reset_parameters()`).
        sync_module_states: broadcast rank 0's parameters and buffers to every rank first.
        **torch_options: torch FSDP's spellings (`sharding_strategy`, `auto_wrap_policy`, `device_id`,
            `forward_prefetch`, `backward_prefetch`, `limit_all_gathers`, `reshard_after_forward`,
            `use_orig_params`, torch's `MixedPrecision` / `MixedPrecisionPolicy` / `CPUOffload`), mapped
            onto the options above (shardtrain/compat.py).

    Raises ValueError or TypeError naming the option and the fix for anything it cannot honour.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"st.shard expects an nn.Module, got {type(model).__name__}")
    if hasattr(model, RUNTIME_ATTR):
        raise ValueError(f"{type(model).__name__} is already sharded; call st.shard once per model")
    options = dict(strategy=strategy, wrap=wrap, mixed_precision=mixed_precision, cpu_offload=cpu_offload,
                   device=device, prefetch=prefetch)
    options.update(translate_torch_options(torch_options, given=_explicit(options)))
    strategy, wrap, mixed_precision, cpu_offload, device, prefetch = (
        options[k] for k in ("strategy", "wrap", "mixed_precision", "cpu_offload", "device", "prefetch"))
    mixed_precision, cpu_offload = translate_policy_objects(mixed_precision=mixed_precision, cpu_offload=cpu_offload)
    if not isinstance(sync_module_states, bool):
        raise TypeError(f"sync_module_states={sync_module_states!r}: use True or False")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r}: give the number of units to gather ahead (0, 1, 2, ...)")
    require_process_group()
    if is_auto(strategy):
        strategy, activation_checkpointing, cpu_offload = _resolve_auto(
            model, strategy, wrap=wrap, mixed_precision=mixed_precision, process_group=process_group)
    strategy = parse_strategy(strategy)
    precision = parse_mixed_precision(mixed_precision)
    offload_policy = parse_cpu_offload(cpu_offload)
    device = resolve_device(device)
    if device.type != "cuda":
        offload_policy = None  # Note: on a CPU device everything already lives in host memory
    if offload_policy and (offload_policy.threads or torch.get_num_threads() < offload_policy.host_threads()):
        # Note: the optimizer steps the offloaded shards with torch's intra-op threads; one thread
        # per process (torchrun's default) made the host AdamW most of the step at 8B.
        torch.set_num_threads(offload_policy.host_threads())
    groups = resolve_groups(strategy, process_group=process_group, mesh=mesh, device=device)
    comm = UnitComm(shard=groups.shard, replicate=groups.replicate, device=device)
    factory = ParamFactory(mesh=groups.mesh)

    plan = partition(model, wrap)
    offloaded = offload_policy.select(s.numel for s in plan.units) if offload_policy else [False] * len(plan.units)
    ac_paths = matching_paths(model, activation_checkpointing, what="activation_checkpointing") \
        if activation_checkpointing is not None else set()
    modules = dict(model.named_modules())
    apply_activation_checkpointing([modules[p] if p else model for p in sorted(ac_paths)])

    runtime = Runtime(
        strategy=strategy, comm=comm, prefetch=prefetch,
        cast_inputs_to=precision.param_dtype if precision.cast_forward_inputs else None,
        control_group=control_group(process_group), order_group=order_group(process_group),
        pinned=PinnedBuffers() if any(offloaded) else None,
    )
    occurrences = {id(p): occ for spec in plan.units for p, occ in zip(spec.params, spec.occurrences)}
    materializer = Materializer(root=model, device=device, param_init_fn=param_init_fn, occurrences=occurrences)
    unit_modules = {id(spec.module) for spec in plan.units}
    broadcast_group = (process_group or dist.group.WORLD) if sync_module_states else None
    for index, spec in enumerate(plan.units):
        originals = list(spec.params)
        materializer.materialize(_scope_modules(spec, unit_modules) + [o.module for occ in spec.occurrences for o in occ])
        tensors = current_tensors(spec)
        layout = layout_of_unit([(occ[0].fqn, tuple(o.fqn for o in occ[1:]), t) for occ, t in zip(spec.occurrences, tensors)],
                                world=comm.shard_world, precision=precision)
        behaviour = UnitBehaviour(
            # Note: the root too: re-gathering it at the start of backward cost nothing measurable,
            # and holding it would add its whole size to the activation peak.
            reshard_after_forward=strategy.reshard_after_forward, resident=strategy.keeps_params_resident,
            reduce_dtype=precision.reduce_dtype, offload=offloaded[index])
        shards = cut_shards(layout, tensors, rank=comm.shard_rank, device=device, broadcast_group=broadcast_group)
        if behaviour.offload:
            shards = [runtime.pinned.empty(s.shape, s.dtype).copy_(s) for s in shards]
        buffers = [FlatBuffers(group=group, members=[layout.params[i] for i in group.members], shard=s,
                               device=device, rank=comm.shard_rank, world=comm.shard_world, offload=behaviour.offload)
                   for group, s in zip(layout.groups, shards)]
        common = dict(index=index, name=spec.name, layout=layout, buffers=buffers, comm=comm, behaviour=behaviour,
                      runtime=runtime, factory=factory)
        unit: ShardUnit
        if runs_sharded_lookup(spec, world=comm.shard_world, behaviour=behaviour):
            unit = LookupUnit(module=spec.module, **common)
        else:
            unit = GatheredUnit(installs=_installs(spec.occurrences), **common)
        _register_params(spec.occurrences, unit.params)
        for old, new, s in zip(originals, unit.params, layout.params):
            replaced.record(old, new, s.fqn)
        runtime.register(unit, spec.module)
    _place_buffers(model, device, precision.buffer_dtype, broadcast_group)
    setattr(model, RUNTIME_ATTR, runtime)
    return model


def _explicit(options: dict[str, Any]) -> set[str]:
    """The options given other than at their defaults (a torch spelling may not contradict them)."""
    defaults = dict(strategy="full_shard", wrap=None, mixed_precision=None, cpu_offload=False, device=None, prefetch=1)
    return {k for k, v in options.items() if v is not defaults[k] and v != defaults[k]}


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


def _register_params(occurrences: list[list[Occurrence]], params: list[nn.Parameter]) -> None:
    for occ, p in zip(occurrences, params):
        for o in occ:
            o.module._parameters[o.attr] = p


def _place_buffers(model: nn.Module, device: torch.device, buffer_dtype: torch.dtype | None,
                   broadcast_group: dist.ProcessGroup | None) -> None:
    paths = {id(m): path for path, m in model.named_modules()}
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            if buf.is_meta:
                where = paths.get(id(module)) or "<root>"
                raise ValueError(f"buffer {name!r} of {type(module).__name__} at '{where}' is still on the meta device; "
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
