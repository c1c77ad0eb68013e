"""What the memory estimator reads from a live `nn.Module`: its units, its shape, and what trains.

The units are the ones `st.shard` would cut (`core.partition`, by `wrap` or the model's own
`default_units()`). The shape comes from a built-in Llama's `cfg`, a Hugging Face model's `config`
(also through a peft wrapper), or the `dim=` / `layers=` hints. What trains is read from each
parameter's `requires_grad`: the trainable count per unit, the bytes the frozen parameters take as
built (they keep that dtype: `policy.storage_dtypes`), and which projections of a block train, by
name (`trained`), so that a peft LoRA model gets the activations of a frozen base.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ...core.partition import partition
from ...models.llama_config import LlamaConfig
from .model_spec import (
    ModelSpec,
    apply_hints,
    shape_from_dims,
    shape_from_hf,
    shape_from_llama,
)
from .sizes import format_count
from .trained import ATTENTION_IN, ATTENTION_OUT, FULL_TRAINING, MLP_IN, MLP_OUT, TrainedParts

_HEADS = ("lm_head", "output")


def _llama_config(module: nn.Module) -> LlamaConfig | None:
    """The configuration of a built-in Llama (a module whose `cfg` is a `LlamaConfig`), else None."""
    cfg = getattr(module, "cfg", None)
    return cfg if isinstance(cfg, LlamaConfig) else None


def _hf_config(module: nn.Module) -> Any:
    """The config of a Llama-style Hugging Face model (RMSNorm, gated feed-forward: Llama, Mistral,
    Qwen2, ...), whose activations the Llama formulas describe; a peft wrapper hands its base model's
    on. None for other models (GPT-2's LayerNorm and GELU save other tensors)."""
    cfg = getattr(module, "config", None)
    llama_style = all(
        hasattr(cfg, a) for a in ("hidden_size", "num_hidden_layers", "intermediate_size", "rms_norm_eps")
    )
    return cfg if llama_style else None


def _default_wrap(module: nn.Module):
    """The model's own `default_units()` (the built-in Llama has one). Otherwise: the element classes of
    the largest nn.ModuleList."""
    own = getattr(module, "default_units", None)
    if callable(own):
        return own()
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return None
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return {type(child) for child in largest}


def trained_parts(module: nn.Module, *, n_layers: int) -> TrainedParts:
    """What trains in the blocks of `module`, read from `requires_grad` by parameter name (a projection
    counts as trained when it or an adapter on it trains in any block). Full training when every
    parameter trains, or when no projection has a name the planner knows."""
    named = list(module.named_parameters())
    if all(p.requires_grad for _, p in named):
        return FULL_TRAINING
    places = {"attention_in": ATTENTION_IN, "attention_out": ATTENTION_OUT, "mlp_in": MLP_IN, "mlp_out": MLP_OUT}
    found = dict.fromkeys(places, False)
    known = norms = head = False
    adapter_rank = 0
    for name, param in named:
        parts = name.split(".")
        for place, names in places.items():
            if any(part in names for part in parts):
                known = True
                found[place] |= param.requires_grad
        norms |= param.requires_grad and any("norm" in part for part in parts)
        head |= param.requires_grad and any(part in _HEADS for part in parts)
        if param.requires_grad and "lora_A" in parts and param.dim() == 2:
            adapter_rank += param.shape[0]
    if not known:
        return FULL_TRAINING
    return TrainedParts(**found, norms=norms, head=head, adapter_rank=adapter_rank // max(1, n_layers))


def spec_of_module(module: nn.Module, wrap, hints: dict[str, Any]) -> ModelSpec:
    """The `ModelSpec` of `module` (module docstring)."""
    parts = partition(module, _default_wrap(module) if wrap is None else wrap)
    units = parts.units
    root, inner = units[0], units[1:]
    enclosing, enclosing_trainable = 0, 0
    for unit in inner:
        outer = [u for u in units if u is root or (u is not unit and unit.name.startswith(u.name + "."))]
        enclosing = max(enclosing, sum(u.numel for u in outer))
        enclosing_trainable = max(enclosing_trainable, sum(_trainable(u.params) for u in outer))
    params = [p for u in units for p in u.params]
    total = sum(p.numel() for p in params)
    notes = list(parts.notes)
    shape = None
    config = _llama_config(module)
    if config is not None:
        shape = apply_hints(shape_from_llama(config), hints)
    elif hints.get("dim"):
        embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
        vocab = max((e.num_embeddings for e in embeddings), default=None)
        filled = {"layers": len(inner) or None, "vocab": vocab, **{k: v for k, v in hints.items() if v}}
        if not filled.get("layers"):
            raise ValueError(f"{type(module).__name__} has no inner units to count as layers; give layers=")
        shape = shape_from_dims(filled["dim"], filled["layers"], filled)
    elif _hf_config(module) is not None:
        shape = apply_hints(shape_from_hf(_hf_config(module)), hints)
    else:
        notes.append(
            f"activations and logits of {type(module).__name__} are not estimated (counted as 0): pass "
            "dim= (and optionally layers=, vocab=, ffn=, heads=, kv_heads=) to estimate them Llama-style"
        )
    trainable = _trainable(params)
    return ModelSpec(
        name=f"{type(module).__name__} ({format_count(total)} params)",
        num_params=total,
        trainable_params=trainable,
        root_params=root.numel,
        enclosing_params=enclosing or root.numel,
        unit_params=tuple(u.numel for u in inner),
        lookup_params=tuple(u.numel for u in inner if u.can_look_up),
        shape=shape,
        notes=tuple(notes),
        param_rows=tuple((p.shape[0], math.prod(p.shape[1:]), p.requires_grad) for p in params if p.dim()),
        trained=trained_parts(module, n_layers=shape.n_layers if shape else max(1, len(inner))),
        frozen_bytes=sum(p.numel() * p.element_size() for p in params if not p.requires_grad),
        quantized_base=any(not p.dtype.is_floating_point for p in params),  # packed 4-bit weights (pretrained/nf4.py)
        root_trainable=_trainable(root.params),
        enclosing_trainable=enclosing_trainable if inner else _trainable(root.params),
        unit_trainable=tuple(_trainable(u.params) for u in inner),
    )


def _trainable(params) -> int:
    return sum(p.numel() for p in params if p.requires_grad)
