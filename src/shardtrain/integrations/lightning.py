"""`ShardtrainStrategy` for the Lightning Trainer: `L.Trainer(strategy=ShardtrainStrategy(wrap={Block}))`.

`setup` shards the LightningModule in place with `st.shard` (modules from `configure_model` built on
the meta device, materialised unit by unit) before `configure_optimizers` runs; Lightning's steps go
through a forward wrapper (`ShardedModule`) so the root unit's parameters are gathered for them;
accumulation, clipping and checkpoints map to `st.no_sync`, `st.clip_grad_norm_` and shardtrain
checkpoint folders. Importing this module registers the name `"shardtrain"` with the Trainer. What the
Trainer's options become: docs/integrations.md, "The Lightning Trainer".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from ._options import HOST_ARGS, register, shard_hosted, strategy_args
from ._wrapped import ShardedModule, sharded_root
from .lightning_precision import ShardtrainPrecision, shardtrain_precision


class _LightningState:
    """Lightning's checkpoint dict without the model and optimizers, saved per rank as an object."""

    def __init__(self, checkpoint: dict[str, Any]) -> None:
        self.checkpoint = checkpoint

    def state_dict(self) -> dict[str, Any]:
        return self.checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.checkpoint = state


class ShardtrainStrategy(DDPStrategy):
    """Trainer strategy that shards the LightningModule with `st.shard` (one process per device).

    Args (keyword-only):
        state_dict_type: "sharded" (default; each rank writes its rows) or "full" checkpoints.
        process_group_backend, timeout, start_method: as Lightning's DDPStrategy.
        **options: `st.shard`'s options (`strategy`, `wrap`, `activation_checkpointing`, `cpu_offload`,
            `mesh`, `prefetch`, `param_init_fn`, `sync_module_states`, torch's spellings); precision,
            device and process group come from the Trainer.
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
            host_args=(*HOST_ARGS, "precision_plugin"),
        )
        super().__init__(**host)
        self._state_dict_type = state_dict_type

    @property
    def precision_plugin(self):
        return self._precision_plugin if self._precision_plugin is not None else ShardtrainPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        self._precision_plugin = None if plugin is None else shardtrain_precision(plugin)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizers exist, and the model is sharded, when the checkpoint loads

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restored them

    # ----------------------------------------------------------------------------- the model

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        with (
            torch.device("meta") if empty_init else contextlib.nullcontext(),
            self.precision_plugin.tensor_init_context(),
        ):
            yield

    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """`configure_model` runs here: its modules are built on meta and materialised, sharded, by setup."""
        with torch.device("meta"):
            yield

    def setup(self, trainer: Any) -> None:
        if self._layer_sync is not None:
            raise ValueError("Trainer(sync_batchnorm=True) is not supported by ShardtrainStrategy; drop it")
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not _is_sharded(module):
            module = self.precision_plugin.convert_module(module)
            shard_hosted(
                module, self._shard_options, device=self.root_device, precision=self.precision_plugin.precision
            )
        self.model = ShardedModule(module)
        self.precision_plugin.sharded = module
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        pass  # st.shard placed each rank's rows on its device

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Accumulating micro-batches keep their gradients local (Lightning enters this for them)."""
        from .. import no_sync

        with no_sync(self.lightning_module):
            yield

    def teardown(self) -> None:
        """Leave the sharded model where it is (moving it to the CPU would tear its shards apart)."""
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---------------------------------------------------------------------------- checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # saved by reference in save_checkpoint

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # saved by reference in save_checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint restored it

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # load_checkpoint restored them

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write the checkpoint folder `filepath` (every rank takes part)."""
        from ..checkpoint import save_checkpoint

        if storage_options is not None:
            raise TypeError("ShardtrainStrategy.save_checkpoint(storage_options=...) is not supported")
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        state = {**self._objects(), "lightning": _LightningState(rest)}
        save_checkpoint(self.broadcast(str(filepath)), state, format=self._state_dict_type)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model and optimizers in place; return the rest of Lightning's checkpoint dict."""
        from ..checkpoint import load_checkpoint

        rest = _LightningState({})
        load_checkpoint(self.broadcast(str(checkpoint_path)), {**self._objects(), "lightning": rest})
        return rest.checkpoint

    def _objects(self) -> dict[str, Any]:
        optimizers = {f"optimizer_{i}": getattr(o, "_optimizer", o) for i, o in enumerate(self.optimizers)}
        return {"model": sharded_root(self.lightning_module), **optimizers}

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register(cls, strategy_registry)


def _is_sharded(module: torch.nn.Module) -> bool:
    try:
        return sharded_root(module) is module
    except ValueError:
        return False


ShardtrainStrategy.register_strategies(StrategyRegistry)
