"""Merging LoRA adapters into their base weights while exporting, one unit at a time.

peft's `merge_and_unload` replaces each adapted weight W by `W + transpose(B @ A) * scaling` (the
transpose only for `fan_in_fan_out` layers such as GPT-2's Conv1D), then drops the adapters. Here
the same sum is formed from the gathered tensors of one unit (W, A and B live in the unit of their
layer), in fp32, and cast to W's export dtype, so no rank needs the whole model or peft's merge. A
4-bit base's W is its dequantised weight (qlora.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.partition import clean_name
from .nf4 import NF4Linear


@dataclass(frozen=True, kw_only=True)
class LoraMerge:
    """One adapted weight: the names of W, A and B, and how B @ A joins W."""

    weight: str
    lora_a: str
    lora_b: str
    scaling: float
    fan_in_fan_out: bool

    def merged(
        self, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, *, dtype: torch.dtype
    ) -> torch.Tensor:
        delta = lora_b.float() @ lora_a.float()
        if self.fan_in_fan_out:
            delta = delta.T
        return (weight.float() + delta * self.scaling).to(dtype)


def lora_merges(model: nn.Module) -> list[LoraMerge]:
    """Every LoRA-adapted weight of `model` (a peft model); ValueError for adapters this merge cannot form."""
    out = []
    for path, module in model.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "scaling")):
            continue
        where = clean_name(path)
        adapters = [a for a in module.active_adapters if a in module.lora_A or a in module.lora_embedding_A]
        if not adapters:
            continue
        if len(adapters) > 1:
            raise ValueError(
                f"{where} has several active LoRA adapters {adapters}; merging exports one: "
                "activate one with set_adapter"
            )
        name = adapters[0]
        unsupported = _unsupported(module, name)
        if unsupported:
            raise ValueError(
                f"{where}: {unsupported} cannot be merged while exporting; export without merging "
                "(--lora.merge_on_export false) and merge with peft's merge_and_unload"
            )
        out.append(
            LoraMerge(
                weight=f"{where}.base_layer.weight",
                lora_a=f"{where}.lora_A.{name}.weight",
                lora_b=f"{where}.lora_B.{name}.weight",
                scaling=float(module.scaling[name]),
                fan_in_fan_out=bool(module.fan_in_fan_out),
            )
        )
    return out


def _unsupported(module: nn.Module, name: str) -> str | None:
    if name in getattr(module, "lora_embedding_A", {}):
        return "a LoRA on an embedding"
    if getattr(module, "use_dora", {}).get(name):
        return "DoRA"
    if getattr(module, "lora_bias", {}).get(name):
        return "a LoRA bias"
    base = module.base_layer
    if not (isinstance(base, (nn.Linear, NF4Linear)) or type(base).__name__ == "Conv1D"):
        return f"a LoRA on {type(base).__name__}"
    return None
