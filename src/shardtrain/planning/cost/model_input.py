"""Any model description a user has at hand, turned into the estimator's `ModelSpec`.

`resolve_model` accepts a built-in Llama size name, a `LlamaConfig`, a parameter count with optional
shape hints, a Hugging Face config (duck-typed), or an `nn.Module` (typically built on the meta
device). It sits above `model_spec` (shapes and specs from names, configs and counts) and
`module_spec` (a live module's units and requires_grad), which import only downward.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...models.llama_config import LLAMA_SIZES, LlamaConfig
from .model_spec import ModelSpec, apply_hints, shape_for_count, shape_from_hf, shape_from_llama, spec_from_shape
from .module_spec import spec_of_module
from .sizes import format_count, parse_count

HINTS = ("dim", "layers", "vocab", "ffn", "heads", "kv_heads", "tie_embeddings")


def resolve_model(model: Any = None, *, params: Any = None, wrap=None, **hints: Any) -> ModelSpec:
    """Turn any accepted model description into a `ModelSpec` (see the module docstring)."""
    unknown = set(hints) - set(HINTS)
    if unknown:
        raise ValueError(f"unknown shape hints {sorted(unknown)}; the hints are {list(HINTS)}")
    for key, value in hints.items():
        if (
            value is not None
            and key != "tie_embeddings"
            and (isinstance(value, bool) or not isinstance(value, int) or value < 1)
        ):
            raise ValueError(f"{key}={value!r} must be a positive integer")
    hints = {k: v for k, v in hints.items() if v is not None}
    if isinstance(model, (int, float, str)) and not isinstance(model, bool):
        if isinstance(model, str) and model.strip().lower() in LLAMA_SIZES:
            model = LLAMA_SIZES[model.strip().lower()]
        elif params is None:
            try:
                model, params = None, parse_count(model, what="model")
            except ValueError:
                raise ValueError(
                    f"model={model!r} is neither a built-in name (one of {list(LLAMA_SIZES)}) nor a "
                    "parameter count such as '7B', '1.5b' or '350M'"
                ) from None
        else:
            raise ValueError(f"model={model!r} and params={params!r} both give a size; give one of them")
    if wrap is not None and not isinstance(model, nn.Module):
        raise ValueError(f"wrap={wrap!r} applies only to an nn.Module model; drop it for {type(model).__name__}")
    if model is not None and params is not None:
        raise ValueError(
            f"params={params!r} is only for a bare parameter count, but model={type(model).__name__} "
            "already fixes it; drop params= (use shape hints such as vocab= to adjust the model)"
        )
    if model is None:
        if params is None:
            raise ValueError(
                "no model given: pass a built-in name such as '8b' (one of "
                f"{list(LLAMA_SIZES)}), a LlamaConfig, a Hugging Face config, an nn.Module, or params='7B'"
            )
        count = parse_count(params)
        return spec_from_shape(f"{format_count(count)} params", shape_for_count(count, hints), params=count)
    if isinstance(model, LlamaConfig):
        shape = apply_hints(shape_from_llama(model), hints)
        return spec_from_shape(f"Llama {format_count(shape.num_params)}", shape)
    if isinstance(model, nn.Module):
        return spec_of_module(model, wrap, hints)
    if hasattr(model, "hidden_size") and hasattr(model, "num_hidden_layers"):
        shape = apply_hints(shape_from_hf(model), hints)
        kind = getattr(model, "model_type", None) or type(model).__name__
        return spec_from_shape(f"{kind} {format_count(shape.num_params)}", shape)
    raise ValueError(
        f"model={model!r} is not understood; pass a built-in name (one of {list(LLAMA_SIZES)}), a "
        "parameter count such as '7B', a LlamaConfig, a Hugging Face config (hidden_size, "
        "num_hidden_layers, ...) or an nn.Module"
    )
