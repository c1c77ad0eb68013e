"""`ShardtrainStrategy` for Lightning Fabric: `L.Fabric(strategy=ShardtrainStrategy(wrap={Block}), ...)`.

The Fabric FSDP guide's loop runs unchanged, each call mapped to its shardtrain counterpart
(`st.shard` materialising a meta-device model unit by unit, `st.clip_grad_norm_`, `st.no_sync`,
`st.save_checkpoint` / `st.load_checkpoint`), with the launcher and process group of Fabric's DDP
strategy. Importing this module registers the name `"shardtrain"`: `L.Fabric(strategy="shardtrain")`
shards with the default options. Each call and precision setting: docs/integrations.md, "Lightning
Fabric".
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn

from ._options import HOST_ARGS, convert_precision, register, shard_hosted, strategy_args
from ._wrapped import ShardedModule, clip_by_value, sharded_root


class ShardtrainMixedPrecision(MixedPrecision):
    """Fabric's "bf16-mixed" / "16-mixed" where `st.shard` gathers the parameters in half precision
    instead of autocast; "16-mixed" scales the loss with `st.GradScaler` (the overflow verdict agreed
    by every rank, which each rank's shard alone cannot give)."""

    def __init__(self, precision: str, device: str) -> None:
        from ..ops.grad_scaler import GradScaler

        super().__init__(precision, device, scaler=GradScaler(device) if precision == "16-mixed" else None)

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def _identity(plugin: Precision) -> Precision:
    return plugin


_PRECISIONS = {
    Precision: _identity,  # "32-true"
    HalfPrecision: _identity,  # "bf16-true": Fabric's own builds and keeps the model in bf16
    MixedPrecision: lambda p: ShardtrainMixedPrecision(p.precision, p.device),
    ShardtrainMixedPrecision: _identity,
}


class ShardtrainStrategy(DDPStrategy):
    """Fabric strategy that shards the model with `st.shard` (one process per device, like DDP).

    Args (keyword-only):
        state_dict_type: "sharded" (each rank writes its rows; loads at any world size) or "full"
            (whole tensors; the weights open with safetensors) for `fabric.save`.
        process_group_backend, timeout, start_method: as Fabric's DDPStrategy.
        **options: `st.shard`'s options (`strategy`, `wrap`, `activation_checkpointing`,
            `cpu_offload`, `mesh`, `prefetch`, `param_init_fn`, `sync_module_states`, torch's
            spellings); precision, device and process group come from Fabric.
        auto_wrap_policy, activation_checkpointing_policy: as Lightning's FSDPStrategy takes them (a set
            of module classes, `ModuleWrapPolicy`, a torch FSDP policy callable): `wrap` and
            `activation_checkpointing` (`_lightning_policies.py`).
        base_bits, load_in_4bit: `base_bits=4` (or `load_in_4bit=True`) stores the frozen base of the peft
            model being set up in NF4 (QLoRA, `st.quantize_base`) before sharding; 16 (default) as built.
    """

    def __init__(self, *, state_dict_type: str = "sharded", checkpoint_io: Any = None, **kwargs: Any) -> None:
        host, self._shard_options = strategy_args(
            state_dict_type=state_dict_type,
            checkpoint_io=checkpoint_io,
            kwargs=kwargs,
            host_args=(*HOST_ARGS, "precision"),
        )
        super().__init__(**host)
        self._state_dict_type = state_dict_type
        self._backward_sync_control = _NoSync()

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        self._precision = None if plugin is None else convert_precision(plugin, _PRECISIONS, host="Fabric")

    @property
    def checkpoint_io(self):
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        if io is not None:
            raise ValueError(f"ShardtrainStrategy does not use CheckpointIO plugins (got {type(io).__name__})")

    # ------------------------------------------------------------------------------- the model

    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """With `empty_init`, build on the meta device: no rank ever holds the whole model."""
        stack = contextlib.ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard `module` in place; return it behind a forward wrapper, so that methods Fabric
        redirects through forward (`training_step`, `mark_forward_method`) gather the root's parameters."""
        shard_hosted(module, self._shard_options, device=self.root_device, precision=self.precision.precision)
        return ShardedModule(module)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, scheduler: Any = None):
        module = self.setup_module(module)
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """An optimizer built before sharding (e.g. over meta parameters) is re-pointed at the shards now,
        so that the loss scaler and clipping see its real gradients from the first step."""
        from ..core.rebind_optimizers import rebind

        rebind(optimizer)
        return optimizer

    def module_to_device(self, module: nn.Module) -> None:
        pass  # st.shard places each rank's rows on its device

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip to the global norm over every rank's shards (the same value on every rank)."""
        from .. import clip_grad_norm_

        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(
            sharded_root(module), max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def clip_gradients_value(self, module: nn.Module, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_by_value(sharded_root(module), clip_val)

    # ---------------------------------------------------------------------------- checkpoints

    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None
    ) -> None:
        """`st.save_checkpoint` of `state` (objects by reference, other values as metadata) into the folder `path`."""
        from ..checkpoint import save_checkpoint

        if storage_options is not None:
            raise TypeError("ShardtrainStrategy.save_checkpoint(storage_options=...) is not supported")
        if filter is not None:
            raise ValueError("fabric.save(filter=...) is not supported by ShardtrainStrategy; save the whole state")
        save_checkpoint(self.broadcast(str(path)), _objects(state), format=self._state_dict_type)

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """`st.load_checkpoint` into the objects of `state`; its plain values are replaced by the stored
        ones, as Fabric does; return the stored values `state` did not ask for."""
        from ..checkpoint import load_checkpoint

        if not isinstance(state, dict) or not state:
            raise ValueError(
                f"ShardtrainStrategy loads into a state dict such as {{'model': model, 'optimizer': opt}}; "
                f"got {type(state).__name__}"
            )
        rest = load_checkpoint(self.broadcast(str(path)), _objects(state), strict=strict)
        for key in [k for k in rest if k in state]:
            state[key] = rest.pop(key)
        return rest

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register(cls, strategy_registry)


class _NoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        from .. import no_sync

        return no_sync(sharded_root(module), enabled=enabled)


def _objects(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with each forward wrapper replaced by the sharded module it holds."""
    return {k: v.module if isinstance(v, ShardedModule) else v for k, v in state.items()}


ShardtrainStrategy.register_strategies(STRATEGY_REGISTRY)
