"""`ShardtrainTrainer`: the Hugging Face Trainer, sharding with shardtrain instead of Accelerate's FSDP.

Swapping `Trainer` for `ShardtrainTrainer` is the whole change to a script: the same
`TrainingArguments` are read (`hf_args.py` says how), the model is sharded in place by `st.shard` when
the Trainer is built, and Accelerate does what it does for a plain model but neither wraps it in DDP
nor shards it again. Other Trainer subclasses (TRL's `SFTTrainer`, `DPOTrainer`) take
`ShardtrainTrainerMixin` (docs/integrations.md, "The Hugging Face Trainer"). The overrides, each the
smallest point the Trainer offers: docs/design.md, Note [Trainer overrides].
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer

from ._frozen import is_sharded, shard_frozen
from ._qlora import chosen_bits, quantize_peft
from ._trl_hash import sharded_hashing
from ._wrapped import sharded_root
from .hf_args import TrainerSharding, trainer_sharding

CHECKPOINT_DIR = "shardtrain"  # inside each checkpoint-N folder the Trainer writes


class ShardtrainTrainerMixin:
    """Put before a `transformers.Trainer` subclass in the bases to shard its model with shardtrain."""

    _sharding: TrainerSharding

    def __init__(self, *args: Any, base_bits: int = 16, load_in_4bit: bool = False, **kwargs: Any) -> None:
        """The host Trainer's arguments, and `base_bits=4` (or `load_in_4bit=True`): the frozen base of the peft
        `model=` is stored in NF4 (QLoRA, `st.quantize_base`) before it is sharded; 16 (default): as built."""
        self._base_bits = chosen_bits(self._owner(), bits=base_bits, load_in_4bit=load_in_4bit)
        with sharded_hashing():  # TRL's DPOTrainer fingerprints the (sharded) model it precomputes with
            super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        if self.model is None:  # Trainer(model_init=...) builds its model later, for each trial
            raise ValueError(
                "ShardtrainTrainer needs model=...; model_init is not supported (it would rebuild the model)"
            )
        self._sharding = trainer_sharding(self.args, self.model)
        init = quantize_peft(self.model, bits=self._base_bits, param_init_fn=None, owner=self._owner())
        self.args = _without_fsdp(self.args)
        super().create_accelerator_and_postprocess()
        self.accelerator.prepare_model = self._prepare_sharded
        self.accelerator.no_sync = self._no_sync
        from .. import shard

        if not dist.is_initialized():  # one process, not launched by torchrun: a world of one
            backend = "nccl" if self.args.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        shard(self.model, device=self.args.device, param_init_fn=init, **self._sharding.shard)

    def _owner(self) -> str:
        return type(self).__name__

    def _prepare_sharded(self, model: nn.Module, device_placement: Any = None, evaluation_mode: bool = False):
        """Accelerate's `prepare_model` for the sharded model: no DDP, no second sharding, no autocast.

        A second model prepared for evaluation only (TRL's `DPOTrainer` reference model, built beside the
        policy) is sharded here, frozen: see `shard_frozen`."""
        if evaluation_mode and model is not self.model and not is_sharded(model):
            return shard_frozen(model, device=self.args.device, shard=self._sharding.shard)
        sharded_root(model)  # raises for a model that is not ours
        self.accelerator._models.append(model)
        return model

    def _no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        from .. import no_sync

        return no_sync(sharded_root(model))

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        pass  # st.shard placed each rank's rows on its device

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        from .. import clip_grad_norm_

        return clip_grad_norm_(sharded_root(model), self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        from ..ops.grad_norm import grad_norm as global_norm

        return global_norm(sharded_root(model)) if grad_norm is None else grad_norm

    # ----------------------------------------------------------------------------- saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write a `from_pretrained` folder (every rank takes part; rank 0 writes), with the tokenizer."""
        from .. import save_pretrained

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_pretrained(sharded_root(self.model), output_dir)
        if self.args.should_save:
            tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        from .. import save_checkpoint

        save_checkpoint(Path(output_dir) / CHECKPOINT_DIR, self._state(), format=self._sharding.checkpoint_format)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Only checks the folder: the weights load with the optimizer, once it exists."""
        if not (Path(resume_from_checkpoint) / CHECKPOINT_DIR).is_dir():
            raise ValueError(
                f"resume_from_checkpoint={str(resume_from_checkpoint)!r} holds no {CHECKPOINT_DIR}/ folder: "
                "it was not written by ShardtrainTrainer; resume from one of its checkpoint-N folders"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        from .. import load_checkpoint

        if checkpoint is not None:
            load_checkpoint(Path(checkpoint) / CHECKPOINT_DIR, self._state())

    def _load_best_model(self) -> None:
        from .. import load_checkpoint

        load_checkpoint(Path(self.state.best_model_checkpoint) / CHECKPOINT_DIR, {"model": sharded_root(self.model)})

    def _state(self) -> dict[str, Any]:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # inside Accelerate's wrapper
        return {"model": sharded_root(self.model), "optimizer": optimizer, "scheduler": self.lr_scheduler}


def _without_fsdp(args: Any) -> Any:
    """A copy of `args` that lets Accelerate neither shard, wrap, autocast nor checkpoint layers itself."""
    args = copy.copy(args)
    args.fsdp = None
    args.fsdp_plugin_args = None
    args.mixed_precision = "no"
    args.activation_checkpointing = False
    return args


class ShardtrainTrainer(ShardtrainTrainerMixin, Trainer):
    """`transformers.Trainer` whose model is sharded by shardtrain (see the module docstring)."""
