"""Activation checkpointing: selected modules recompute their activations in backward.

The module's `forward` is wrapped (not its `__call__`), so a unit's hooks stay outside the
checkpointed region: the parameters are gathered before the region runs and gathered again by
the pre-backward hook before the recomputation needs them.

A Hugging Face model fills a key/value cache during forward when `use_cache` is on (its config's
default); a checkpointed layer recomputed in backward would write into that cache again and save
other tensors than its forward did (T5: torch's CheckpointError). As transformers does under its own
gradient checkpointing, such a model's forwards that build a graph run with `use_cache=False`;
evaluation and generation keep the cache.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(model: nn.Module, modules: list[nn.Module]) -> None:
    """Recompute each of `modules` (inside `model`) in backward."""
    if modules:
        _no_cache_while_training(model)
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
        module.__dict__["_shardtrain_checkpointed"] = True  # a plain attribute (what nn.Module sets for a bool)


def _no_cache_while_training(model: nn.Module) -> None:
    """Forwards that build a graph pass `use_cache=False` to the outermost modules that take it (module docstring)."""
    taken: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(f"{t}.") for t in taken) or not _takes_use_cache(module):
            continue
        taken.append(path)
        module.register_forward_pre_hook(_without_cache, with_kwargs=True)


def _takes_use_cache(module: nn.Module) -> bool:
    if not hasattr(getattr(module, "config", None), "use_cache"):
        return False
    try:
        return "use_cache" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _without_cache(module: nn.Module, args: tuple, kwargs: dict):
    if module.training and torch.is_grad_enabled():
        kwargs["use_cache"] = False
    return args, kwargs
