"""`st.GradScaler`: dynamic loss scaling for fp16 training of a sharded model.

Each rank checks only its own shard of the gradients for inf/NaN, so an overflow can be visible on
one rank alone. The scaler therefore all-reduces the overflow flag before deciding: every rank
skips the same steps and halves (or grows) its scale in lockstep. It unscales the gradients' local
rows (a sharded model's `.grad` are DTensors, whose dispatch would otherwise reduce each check).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from ..core.sharded_param import local_of


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose inf/NaN verdict is agreed by all ranks of `process_group`."""

    def __init__(
        self,
        device: str | None = None,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
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

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale every gradient's local rows in place, one fused check per device and dtype; return the
        per-device inf/NaN flags (the contract of torch's GradScaler)."""
        grads: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = local_of(param.grad)
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError(
                        "st.GradScaler: gradients are fp16; keep fp32 master weights (the default "
                        "under mixed_precision='fp16') so that they can be unscaled"
                    )
                grads[grad.device][grad.dtype].append(grad)
        flags = {}
        with torch.no_grad():
            for device, by_dtype in grads.items():
                flags[device] = found_inf.to(device, copy=True)
                scale = inv_scale.to(device)
                for tensors in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(tensors, flags[device], scale)
        return flags
