"""`st.shard_auto`: plan a built model for the batch its loop feeds, then shard it with the choice.

The automatic plan is a tool above the entry point: it reads the options once (`resolve_options`),
asks `choose_plan` for the strategy, activation checkpointing and offload that fit, and calls
`st.shard`'s resolved form (`sharding.shard_with`). The caller's loop fixes the micro-batch, so
only those three are chosen; nothing is printed (the caller prints the returned `AutoChoice` if it
wants to). `st.shard(strategy="auto")` refuses with a pointer here: the plan needs the sequence
length, which a model does not carry.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from ...core.process_groups import require_process_group
from ...options import ShardOptions, resolve_options
from ...policy import AutoPolicy
from ...sharding import shard_with
from ...tp.mesh import is_tensor_parallel_mesh
from ...tp.refusals import refuse_auto
from .auto import SAFETY_MARGIN, choose_plan
from .choice import AutoChoice


def shard_auto(model: nn.Module, *, policy: AutoPolicy, **options: Any) -> tuple[nn.Module, AutoChoice]:
    """Shard `model` in place with the fastest configuration predicted to fit; return it and the choice.

    `policy` gives the batch the loop feeds (`st.AutoPolicy(micro_batch=..., seq_len=...)`) and the
    device memory; `options` are `st.shard`'s keyword arguments (`wrap=` is required) except the
    strategy, activation checkpointing and offload, which the plan chooses.
    """
    chosen_here = sorted({"strategy", "activation_checkpointing", "cpu_offload"} & set(options))
    if chosen_here:
        raise TypeError(f"st.shard_auto chooses {chosen_here} itself; drop them, or call st.shard with your own")
    return shard_auto_with(model, policy, resolve_options(**options))


def shard_auto_with(model: nn.Module, policy: AutoPolicy, options: ShardOptions) -> tuple[nn.Module, AutoChoice]:
    """`shard_auto` with the other options already resolved (the Engine's form)."""
    if not isinstance(policy, AutoPolicy):
        raise TypeError(f"policy={policy!r}: pass st.AutoPolicy(micro_batch=..., seq_len=...)")
    refuse_auto(
        auto=True,
        tp=options.tp_plan is not None or is_tensor_parallel_mesh(options.mesh),
        spelled="st.shard_auto with tp_plan= or a mesh with a 'tp' dimension",
    )
    require_process_group()
    choice = resolve_auto(
        model,
        world_size=dist.get_world_size(options.process_group),
        micro_batch=policy.micro_batch,
        seq_len=policy.seq_len,
        grad_accum=policy.grad_accum,
        wrap=options.wrap,
        device_memory=policy.device_memory,
        host_memory=policy.host_memory,
        disk_dir=policy.disk_dir,
        mixed_precision=options.precision,
    )
    return shard_with(model, choice.applied_to(options, model)), choice


def resolve_auto(
    model: nn.Module,
    *,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    wrap: Any,
    device_memory: int | str | None = None,
    host_memory: int | str | None = None,
    disk_dir: str | None = None,
    grad_accum: int = 1,
    mixed_precision: Any = "bf16",
    optimizer: Any = "adamw",
    allow_offload: bool = True,
    safety_margin: float = SAFETY_MARGIN,
) -> AutoChoice:
    """The automatic plan for `st.shard(model, wrap=wrap, ...)`: strategy, checkpointing and offload.

    `st.shard_auto`'s request to `choose_plan` (the one function that chooses), with nothing chosen here.

    The micro-batch stays as the caller's loop feeds it (`micro_batch` sequences of `seq_len` tokens
    per device, `grad_accum` micro-batches per step). `device_memory` defaults to the local GPU's;
    `host_memory` (per process) to this host's share when planning for the local GPUs or when `disk_dir`
    offers the disk tier (weighed only when nothing fits with device and host memory).
    Apply the answer with `choice.applied_to(options, model)` or `choice.shard_kwargs(model, wrap=wrap)`.
    """
    if wrap is None:
        raise ValueError(
            "the automatic plan needs wrap= (e.g. the transformer block class): with the whole model as "
            "one unit every strategy gathers all parameters at once and checkpointing has no blocks"
        )
    return choose_plan(
        model,
        world_size=world_size,
        device_memory=device_memory,
        seq_len=seq_len,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        precision=mixed_precision,
        optimizer=optimizer,
        split_batch=False,
        allow_offload=allow_offload,
        safety_margin=safety_margin,
        host_memory=host_memory,
        disk_dir=disk_dir,
        wrap=wrap,
        accelerator="cuda",
    )
