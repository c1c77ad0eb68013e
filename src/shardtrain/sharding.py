"""`st.shard`: the public entry point, and its specification (the docstring below).

It parses every accepted spelling of every option (shardtrain's, torch FSDP's through compat.py),
resolves strategy="auto" with the planner, and hands concrete options to the engine
(`core.shard.shard_module`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .compat import translate_policy_objects, translate_torch_options
from .core.process_groups import require_process_group, resolve_device
from .core.shard import RUNTIME_ATTR, shard_module
from .policy import (
    AutoPolicy,
    CPUOffload,
    MixedPrecision,
    WrapPolicy,
    is_auto,
    parse_cpu_offload,
    parse_mixed_precision,
)
from .strategy import Strategy, parse_strategy


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
    tp_plan: Mapping[str, Any] | None = None,
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
            per node). With tensor parallelism, a DeviceMesh with dimensions ("dp", "tp") (hybrid:
            ("replicate", "shard", "tp")): each parameter's TP-local tensor is sharded over "dp", and
            the optimizer sees DTensors on the whole mesh with torch FSDP2's placements.
        tp_plan: with a tensor-parallel mesh, the plan `parallelize_module(model, mesh["tp"], plan)`
            applies first (`st.tp.llama_plan()`, `st.tp.hf_plan(model)`, or transformers' strings
            "colwise" / "rowwise"); None when the model went through parallelize_module already.
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
    options = dict(
        strategy=strategy,
        wrap=wrap,
        mixed_precision=mixed_precision,
        cpu_offload=cpu_offload,
        device=device,
        prefetch=prefetch,
    )
    options.update(translate_torch_options(torch_options, given=_explicit(options)))
    strategy, wrap, mixed_precision, cpu_offload, device, prefetch = (
        options[k] for k in ("strategy", "wrap", "mixed_precision", "cpu_offload", "device", "prefetch")
    )
    mixed_precision, cpu_offload = translate_policy_objects(mixed_precision=mixed_precision, cpu_offload=cpu_offload)
    if not isinstance(sync_module_states, bool):
        raise TypeError(f"sync_module_states={sync_module_states!r}: use True or False")
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"param_init_fn={param_init_fn!r}: pass a callable(module) that fills its parameters, or None")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group={process_group!r}: pass a torch.distributed ProcessGroup (dist.new_group(ranks)), "
            "or None for every rank"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r}: give the number of units to gather ahead (0, 1, 2, ...)")
    require_process_group()
    if is_auto(strategy):
        strategy, activation_checkpointing, cpu_offload = _resolve_auto(
            model, strategy, wrap=wrap, mixed_precision=mixed_precision, process_group=process_group
        )
    strategy = parse_strategy(strategy)
    precision = parse_mixed_precision(mixed_precision)
    offload = parse_cpu_offload(cpu_offload)
    device = resolve_device(device)
    if device.type != "cuda":
        offload = None  # Note: on a CPU device everything already lives in host memory
    return shard_module(
        model,
        strategy=strategy,
        wrap=wrap,
        precision=precision,
        activation_checkpointing=activation_checkpointing,
        offload=offload,
        mesh=mesh,
        device=device,
        process_group=process_group,
        prefetch=prefetch,
        param_init_fn=param_init_fn,
        sync_module_states=sync_module_states,
        tp_plan=tp_plan,
    )


def _explicit(options: dict[str, Any]) -> set[str]:
    """The options given other than at their defaults (a torch spelling may not contradict them)."""
    defaults = dict(strategy="full_shard", wrap=None, mixed_precision=None, cpu_offload=False, device=None, prefetch=1)
    return {k for k, v in options.items() if v is not defaults[k] and v != defaults[k]}


def _resolve_auto(model: nn.Module, policy: Any, *, wrap: Any, mixed_precision: Any, process_group):
    """strategy="auto": the planner's fastest configuration predicted to fit (planning/auto.py)."""
    from .planning.auto import resolve_auto

    if not isinstance(policy, AutoPolicy):
        seq_len = getattr(getattr(model, "cfg", None), "max_seq_len", None)
        if seq_len is None:
            raise ValueError(
                "strategy='auto' cannot tell the sequence length of this model; pass "
                "strategy=st.AutoPolicy(micro_batch=..., seq_len=...) instead"
            )
        policy = AutoPolicy(micro_batch=1, seq_len=seq_len)
    choice = resolve_auto(
        model,
        world_size=dist.get_world_size(process_group),
        micro_batch=policy.micro_batch,
        seq_len=policy.seq_len,
        grad_accum=policy.grad_accum,
        wrap=wrap,
        device_memory=policy.device_memory,
        mixed_precision=mixed_precision or "fp32",
    )
    if dist.get_rank() == 0:
        print(choice, flush=True)
    chosen = choice.shard_kwargs(model, wrap=wrap)
    return chosen["strategy"], chosen["activation_checkpointing"], chosen["cpu_offload"]
