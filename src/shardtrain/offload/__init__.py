"""CPU offload: the offloaded units' optimizer step on the host, deferred and overlapped with the GPU's
work (host_step, step_queue, optimizer_view), stepped during backward where the loop allows it
(backward_step), their optimizer state in per-rank files (the disk tier: disk_state, disk_layout,
disk_file, disk_pool, aio), and the exact-size page-locked host buffers of their shards and gradients
(pinned). `attach.shard_offloaded` is what `st.shard` calls; the runtime reaches the host step only
through core's `StepHook` (core/step_hook.py). The policy, `st.CPUOffload`, lives in policy.py beside
the other options `ShardOptions` carries.

The face the rest of shardtrain may use:

- `shard_offloaded(model, options)`: `st.shard`'s engine call (core's `shard_module`, then the offload).
- `DEFAULT_SLOTS`: the disk tier's default pool, in units, which the planner's estimate reuses.
"""

from .attach import shard_offloaded
from .disk_state import DEFAULT_SLOTS

__all__ = ["DEFAULT_SLOTS", "shard_offloaded"]
