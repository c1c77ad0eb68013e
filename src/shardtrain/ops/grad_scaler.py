"""`st.GradScaler`: dynamic loss scaling for fp16 training of a sharded model.

Each rank checks only its own shard of the gradients for inf/NaN, so an overflow can be visible on
one rank alone. The scaler therefore all-reduces the overflow flag before deciding: every rank
skips the same steps and halves (or grows) its scale in lockstep.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose inf/NaN verdict is agreed by all ranks of `process_group`."""

    def __init__(self, device: str | None = None, *, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 process_group: dist.ProcessGroup | None = None) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self.process_group = process_group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if not found:
            # Note: a rank whose shard holds no gradient must still take part in the agreement.
            found[torch.device(self._device)] = torch.zeros(1, device=self._device)
        if dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            for flag in found.values():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
