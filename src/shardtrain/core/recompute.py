"""Activation checkpointing: selected modules recompute their activations in backward.

The module's `forward` is wrapped (not its `__call__`), so a unit's hooks stay outside the
checkpointed region: the parameters are gathered before the region runs and gathered again by
the pre-backward hook before the recomputation needs them.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(modules: list[nn.Module]) -> None:
    for module in modules:
        if getattr(module, "_shardtrain_checkpointed", False):
            continue
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return _inner(*args, **kwargs)

        module.forward = forward
        module._shardtrain_checkpointed = True
