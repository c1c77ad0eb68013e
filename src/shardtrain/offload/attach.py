"""`st.shard` with CPU offload: the host's threads, page-locked shards, and the host step hooked in.

Core shards the model and knows nothing of offload beyond its units' `offload` switch, a `HostBuffers`
allocator for their shards and gradients, and the runtime's `StepHook` (core/step_hook.py). This
module supplies the rest: `shard_offloaded` sets the host's intra-op threads, hands core the
exact-size pinned allocator (offload/pinned.py), then attaches the deferred per-unit host step
(offload/host_step.py) as the runtime's step hook and, with `disk_dir`, the disk tier
(offload/disk_state.py).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from ..core import resolve_device, runtime_of, shard_module
from ..options import ShardOptions
from ..policy import CPUOffload
from .disk_state import DiskState
from .host_step import HostSteps, overlap_host_steps
from .pinned import PinnedBuffers


def shard_offloaded(model: nn.Module, options: ShardOptions) -> nn.Module:
    """Shard `model` in place (core's `shard_module`) with the offload `options` ask for."""
    # Note: on a CPU device everything already lives in host memory.
    offload = options.offload if resolve_device(options.device).type == "cuda" else None
    if offload and (offload.threads or torch.get_num_threads() < offload.host_threads()):
        # Note: the optimizer steps the offloaded shards with torch's intra-op threads; one thread
        # per process (torchrun's default) made the host AdamW most of the step at 8B.
        torch.set_num_threads(offload.host_threads())
    shard_module(model, options, host_buffers=PinnedBuffers)
    runtime = runtime_of(model, settle=False)
    offloaded_units = [u for u in runtime.units if u.behaviour.offload]
    if offload is None or not offloaded_units:
        return model
    steps = (
        overlap_host_steps(model, runtime, offloaded_units, in_backward=offload.step_in_backward)
        if options.overlap_host_step
        else None
    )
    if offload.disk_dir is not None:
        attach_disk_state(steps, offload, rank=dist.get_rank() if dist.is_initialized() else 0)
    return model


def attach_disk_state(steps: HostSteps | None, policy: CPUOffload, *, rank: int) -> DiskState:
    """Keep the optimizer state of the units `steps` defers in files under `policy.disk_dir`."""
    # Note: resolve_options refuses the disk tier with SHARDTRAIN_HOST_STEP=sequential (no deferred steps).
    assert steps is not None, "the disk tier streams the state through the per-unit host step"
    assert policy.disk_dir is not None, "attach_disk_state is for a policy with a disk_dir"
    steps.store = DiskState(directory=os.fspath(policy.disk_dir), rank=rank, buffer_bytes=policy.disk_buffer_bytes)
    return steps.store
