"""`st.shard`: the public entry point, and its specification (the docstring below).

It reads every accepted spelling of every option once (`options.resolve_options`: shardtrain's,
torch FSDP's through compat.py) and hands the resulting `ShardOptions` to the engine
(`core.shard_module.shard_module`, through the offload package's `offload.attach.shard_offloaded`). The automatic plan (`st.shard_auto`, planning/cost/shard_auto.py) sits
above this entry point and calls it with the options it chose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .core.process_groups import require_process_group
from .core.shard_module import RUNTIME_ATTR
from .offload import shard_offloaded
from .options import ShardOptions, resolve_options
from .policy import CPUOffload, MixedPrecision, WrapPolicy
from .strategy import Strategy


def shard(
    model: nn.Module,
    *,
    strategy: Strategy | str = "full_shard",
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
            of `mesh`, replicated across them). torch's names (`ShardingStrategy` members, "FULL_SHARD")
            are accepted. "auto" / `st.AutoPolicy(...)` is refused with a pointer to `st.shard_auto`,
            which plans (it needs the sequence length) and then calls st.shard.
        wrap: which modules become units: a set of module classes, `st.SizePolicy(min_params=...)`, or
            a callable(module) -> bool. The root is always a unit; each parameter belongs to the
            innermost unit holding it; a parameter tied across units moves to their common ancestor.
            `st.plan(model, wrap=...)` prints the units without a process group.
        mixed_precision: "bf16", "fp16" (with `st.GradScaler`), "fp32", or `st.MixedPrecision(...)`.
            Trainable parameters keep an fp32 master whatever dtype the model was built in; frozen
            parameters keep their dtype. Units may mix dtypes.
        activation_checkpointing: modules (a policy like `wrap`) whose activations are recomputed in
            backward.
        cpu_offload: True, a share of the parameters such as 0.5 (whole units, the last of the plan order first), or
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
    return shard_with(
        model,
        resolve_options(
            strategy=strategy,
            wrap=wrap,
            mixed_precision=mixed_precision,
            activation_checkpointing=activation_checkpointing,
            cpu_offload=cpu_offload,
            mesh=mesh,
            device=device,
            process_group=process_group,
            prefetch=prefetch,
            param_init_fn=param_init_fn,
            sync_module_states=sync_module_states,
            tp_plan=tp_plan,
            **torch_options,
        ),
    )


def shard_with(model: nn.Module, options: ShardOptions) -> nn.Module:
    """`st.shard` with its options already resolved (`options.resolve_options`): what the Engine, the
    automatic plan and the trainer adapters call after reading their own users' settings once."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"st.shard expects an nn.Module, got {type(model).__name__}")
    if hasattr(model, RUNTIME_ATTR):
        raise ValueError(f"{type(model).__name__} is already sharded; call st.shard once per model")
    _refuse_bitsandbytes(model)
    require_process_group()
    return shard_offloaded(model, options)


def _refuse_bitsandbytes(model: nn.Module) -> None:
    """ValueError for a model holding bitsandbytes' quantised parameters (a model loaded with
    `BitsAndBytesConfig(load_in_4bit=True)` or `load_in_8bit=True`): their packed storage and the quant
    state beside it are not a tensor whose rows a rank can hold, and bitsandbytes' kernels repack them in
    place, so sharding them would crash or compute garbage. shardtrain's own 4-bit base shards instead."""
    found = next(
        (
            (name, type(p).__name__)
            for name, p in model.named_parameters()
            if type(p).__module__.startswith("bitsandbytes")
        ),
        None,
    )
    if found is not None:
        name, kind = found
        raise ValueError(
            f"{name} is a bitsandbytes {kind} (a model loaded with BitsAndBytesConfig): its packed weights cannot "
            "be sharded. Load the model in 16 bits and let shardtrain store the frozen base in 4 bits "
            "(st.quantize_base; base_bits=4 or load_in_4bit=True in the trainer integrations; --lora.base_bits 4), "
            "or save it with save_pretrained and load that folder with st.load_pretrained / --model.pretrained, "
            "which read bitsandbytes' layout (docs/pretrained.md)"
        )
