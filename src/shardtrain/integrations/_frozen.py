"""A second, frozen model beside the trained one: TRL's `DPOTrainer` reference model, sharded like the policy.

`DPOTrainer` (full fine-tuning, no `precompute_ref_log_probs`) builds a reference model from the policy's
folder and hands it to Accelerate's `prepare_model(..., evaluation_mode=True)`. Under the shardtrain mixin
it is sharded with the policy's options but frozen: no gradient storage, no communication in backward, no
activation checkpointing (it only runs under `torch.no_grad`). Its rows are kept as the policy's are
(under bf16 both compute on the same bf16 casts), so before the first step the two models' log-probabilities
agree exactly and the DPO rewards start at 0. Each rank keeps its rows; a forward gathers one unit at a time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.shard_module import RUNTIME_ATTR


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` (or a module inside it) was sharded by `st.shard`."""
    return any(hasattr(m, RUNTIME_ATTR) for m in model.modules())


def shard_frozen(model: nn.Module, *, device: torch.device, shard: dict[str, Any]) -> nn.Module:
    """`model` frozen and sharded in place with the trained model's `st.shard` options `shard`."""
    from .. import shard as st_shard

    model.requires_grad_(False)
    model.eval()
    options = {**shard, "activation_checkpointing": None}
    return st_shard(model, device=device, **options)
