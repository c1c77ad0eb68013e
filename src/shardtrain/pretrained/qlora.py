"""QLoRA: LoRA over a base whose frozen linear layers are stored in 4 bits (nf4.py), sharded like any
frozen parameter.

`quantize_base(model)` turns every frozen `nn.Linear` of a meta-device peft model but the output head
into an `NF4Linear` before `st.shard`, so nothing in the engine knows the format. The files hold the
weights in 16 or 32 bits (or quantised by bitsandbytes, which the loader dequantises first: bnb_layout.py):
`QuantizedWeight` lets the loader read one layer's weight whole (the scales' mean spans it), have torchao
quantise it and keep its rank's rows, and the exporter write it dequantised (docs/pretrained.md, "QLoRA:
LoRA over a 4-bit base").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..core.param_layout import ParamShard
from ..core.partition import clean_name
from .keys import hf_model
from .nf4 import COMPONENTS, NF4Linear, dequantize, quantizable

BITS = (4, 16)  # 16: the base as built (no quantisation)


def quantize_base(
    model: nn.Module, *, bits: int = 4, param_init_fn: Callable[[nn.Module], None] | None = None
) -> Callable[[nn.Module], None] | None:
    """Replace every frozen `nn.Linear` of `model` but the output head by an `NF4Linear` (module
    docstring), in place, on whatever device the model is (meta: nothing is allocated; a materialised
    layer's weight is quantised as it is replaced, for a model a trainer shards), and return the
    `param_init_fn` to pass to `st.shard` / `Engine.setup`: each NF4Linear draws its weight as
    `nn.Linear` would and quantises it (one layer at a time; `st.load_pretrained` then replaces it by the
    file's weights, quantised as read); every other module gets `param_init_fn`, else, in a peft model,
    peft's adapter initialisation (`lora.adapter_init`), else what `st.shard` gives it.

    `bits=16` changes nothing and returns `param_init_fn`. ValueError when nothing is frozen (apply LoRA first).
    """
    if bits not in BITS:
        raise ValueError(f"base_bits={bits!r}: use 4 (an NF4 base, QLoRA) or 16 (the base as built)")
    if bits == 16:
        return param_init_fn
    hf = hf_model(model)
    head = hf.get_output_embeddings() if hf is not None and hasattr(hf, "get_output_embeddings") else None
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if quantizable(child) and child is not head and not child.weight.requires_grad
    ]
    if not swaps:
        raise ValueError(
            "base_bits=4 found no frozen nn.Linear to quantise; apply LoRA first (only the adapters train, "
            "the base is frozen), e.g. peft's get_peft_model or --lora.rank 8"
        )
    if param_init_fn is None and hasattr(model, "peft_config"):
        from .lora import adapter_init

        param_init_fn = adapter_init(model)
    for parent, name, child in swaps:
        layer = NF4Linear.replacing(child)
        if not child.weight.is_meta:  # a materialised model (a trainer's): its weights, quantised now
            with torch.no_grad():
                for key, value in layer.quantize_from(child.weight).items():
                    getattr(layer, key).copy_(value)
        setattr(parent, name, layer)
    return _quantized_init(param_init_fn, model)


def _quantized_init(init: Callable[[nn.Module], None] | None, model: nn.Module) -> Callable[[nn.Module], None]:
    from ..core.materialize import DefaultInit

    rest = init if init is not None else DefaultInit(model)

    def run(module: nn.Module) -> None:
        if isinstance(module, NF4Linear):
            module.reset_parameters()
        else:
            rest(module)

    return run


@dataclass(frozen=True, kw_only=True)
class QuantizedWeight:
    """The weight one NF4Linear encodes: its name as an `nn.Linear` would have it, shape, and components."""

    name: str  # e.g. base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight
    shape: tuple[int, int]
    dtype: torch.dtype
    components: tuple[str, ...]  # the component parameters' names, in COMPONENTS order
    module: NF4Linear

    def as_shard(self) -> ParamShard:
        """A stand-in parameter of the weight's name and shape, for matching it to its file key."""
        return ParamShard(
            fqn=self.name, shape=self.shape, dtype=self.dtype, compute_dtype=self.dtype, requires_grad=False, world=1
        )

    def quantize(self, weight: torch.Tensor) -> list[torch.Tensor]:
        """`weight` (whole, as the file holds it) quantised: the components, whole, in `components` order."""
        parts = self.module.quantize_from(weight)
        return [parts[name] for name in COMPONENTS]

    def dequantize(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The weight from its whole components (in `components` order)."""
        return dequantize(*parts, shape=self.shape)


def quantized_weights(model: nn.Module) -> list[QuantizedWeight]:
    """Every NF4Linear of `model` as a `QuantizedWeight` (empty for a model without them)."""
    out = []
    for path, module in model.named_modules():
        if isinstance(module, NF4Linear):
            where = clean_name(path)
            out.append(
                QuantizedWeight(
                    name=f"{where}.weight",
                    shape=(module.out_features, module.in_features),
                    dtype=module.dtype,
                    components=tuple(f"{where}.{c}" for c in COMPONENTS),
                    module=module,
                )
            )
    return out
