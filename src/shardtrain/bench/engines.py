"""One small adapter per engine: build the benchmark model under it and return (model, optimizer).

Every adapter starts from the same meta-device Llama (`model.build_meta_model`), initialises it by
name (`model.NamedModel`), uses the same precision (bf16 compute with fp32 master weights and fp32
gradient reduction, or fp32 throughout), the same activation checkpointing of every Block when asked,
and fused AdamW at lr 1e-4. Units: shardtrain gets a unit per Block, the embedding and the output
head (`models.llama.SHARD_UNITS`); FSDP2 per Block and on the root (or `fsdp2-split` for
shardtrain's units); FSDP1 per Block.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..models.llama import SHARD_UNITS, Block, Llama
from .same_weights import build_meta_model
from .spec import RunSpec

LEARNING_RATE = 1e-4


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A model ready to train: call `model(tokens)` (under autocast to `autocast_dtype` if set), then
    `loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)`."""

    model: nn.Module
    optimizer: Any  # a torch optimizer, or anything with step() and zero_grad(set_to_none=...)
    autocast_dtype: torch.dtype | None = None
    label: str | None = None  # replaces the engine's label when the build decided something (auto)


def compute_dtype(spec: RunSpec) -> torch.dtype | None:
    """The low-precision compute dtype, or None when the run is fp32 throughout."""
    return torch.bfloat16 if spec.precision == "bf16" else None


def make_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """Fused AdamW; the foreach implementation where this build has no fused kernel for the device."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True)
    except RuntimeError:
        return torch.optim.AdamW(params, lr=LEARNING_RATE, foreach=True)


def compile_blocks(model: nn.Module) -> int:
    """`Block.compile()` on every Llama block of `model` (on its checkpoint wrapper where it has one, so the
    recomputation is compiled too), as torchtitan compiles per block; returns how many were compiled."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    blocks = [
        m
        for m in model.modules()
        if isinstance(m, CheckpointWrapper) and isinstance(m._checkpoint_wrapped_module, Block)
    ]
    wrapped = {id(m._checkpoint_wrapped_module) for m in blocks}
    blocks += [m for m in model.modules() if isinstance(m, Block) and id(m) not in wrapped]
    for block in blocks:
        block.compile()
    return len(blocks)


def checkpoint_blocks(model: Llama) -> None:
    """Wrap every Block in torch's non-reentrant checkpoint wrapper (before an engine wraps it)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def build_shardtrain(spec: RunSpec, device: torch.device, *, strategy: str) -> Prepared:
    named = build_meta_model(spec.model_config(), float8=spec.float8)
    model = _shard(named, spec, device, strategy=strategy, activation_checkpointing={Block} if spec.ac else None)
    return Prepared(model=model, optimizer=make_optimizer(model.parameters()))


def build_shardtrain_auto(spec: RunSpec, device: torch.device) -> Prepared:
    """strategy="auto" for this run's micro-batch: the planner picks strategy, checkpointing and offload
    (so `--ac` does not apply); the row's label names what it picked."""
    from ..planning.cost.machine import local_device_memory
    from ..planning.cost.report import checkpointing_label
    from ..planning.cost.shard_auto import resolve_auto

    named = build_meta_model(spec.model_config(), float8=spec.float8)
    precision = "bf16" if compute_dtype(spec) else "fp32"
    memory, _ = local_device_memory(
        accelerator=device.type, processes=1 if device.type == "cuda" else dist.get_world_size()
    )
    choice = resolve_auto(
        named.model,
        world_size=dist.get_world_size(),
        micro_batch=spec.batch,
        seq_len=spec.seq,
        wrap=SHARD_UNITS,
        device_memory=memory,
        mixed_precision=precision,
    )
    model = _shard(named, spec, device, **choice.shard_kwargs(named.model, wrap=SHARD_UNITS))
    checkpointing = f"ckpt {checkpointing_label(choice.recompute_every)}"
    offload = ", offload" if choice.cpu_offload else ""
    return Prepared(
        model=model,
        optimizer=make_optimizer(model.parameters()),
        label=f"shardtrain auto ({choice.strategy.value}, {checkpointing}{offload})",
    )


def _shard(named, spec: RunSpec, device: torch.device, **options: Any) -> nn.Module:
    import shardtrain as st

    return st.shard(
        named.model,
        wrap=SHARD_UNITS,
        mixed_precision="bf16" if compute_dtype(spec) else None,
        device=device,
        param_init_fn=named.param_init_fn(seed=spec.seed, device=device, allocate=False),
        **options,
    )


def build_fsdp2(
    spec: RunSpec, device: torch.device, *, reshard_after_forward: bool, split_root: bool = False
) -> Prepared:
    """The FSDP2 baseline: `fully_shard` per Block and on the root; `split_root` also gives the
    embedding and the output head their own units, as shardtrain's plan does (torchtitan's recipe)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    named = build_meta_model(spec.model_config(), float8=spec.float8)
    model = named.model
    if spec.ac:
        checkpoint_blocks(model)
    dtype = compute_dtype(spec)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    units = [model.embed, *model.layers, model.head] if split_root else list(model.layers)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    model.to_empty(device=device)
    named.init_all_(seed=spec.seed, device=device)
    return Prepared(model=model, optimizer=make_optimizer(model.parameters()))


def build_fsdp1(spec: RunSpec, device: torch.device) -> Prepared:
    """torch FSDP1 in its usual setup: FULL_SHARD, limit_all_gathers, use_orig_params, fp32 reduction."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    named = build_meta_model(spec.model_config(), float8=spec.float8)
    dtype = compute_dtype(spec)
    model = FullyShardedDataParallel(
        named.model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None,
        limit_all_gathers=True,
        use_orig_params=True,
        device_id=device,
        param_init_fn=named.param_init_fn(seed=spec.seed, device=device, allocate=True),
    )
    if spec.ac:
        # FSDP1's recipe: checkpoint inside each FSDP unit, after wrapping.
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda module: isinstance(module, Block),
        )
    return Prepared(model=model, optimizer=make_optimizer(model.parameters()))


def build_ddp(spec: RunSpec, device: torch.device) -> Prepared:
    """DDP: every rank holds the whole fp32 model; bf16 compute through autocast."""
    from torch.nn.parallel import DistributedDataParallel

    named = build_meta_model(spec.model_config(), float8=spec.float8)
    model = named.model
    model.to_empty(device=device)
    named.init_all_(seed=spec.seed, device=device)
    if spec.ac:
        checkpoint_blocks(model)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return Prepared(model=ddp, optimizer=make_optimizer(ddp.parameters()), autocast_dtype=compute_dtype(spec))
