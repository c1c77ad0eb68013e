"""float8 in the memory estimate (`st.estimate_memory(float8=True)`): which Linears convert, by
float8_rule.py's rule, and the bytes that adds.

torchao's `Float8Linear` (tensorwise, dynamic scaling) saves its high-precision input and weight for
backward as `nn.Linear` does (torchao 0.18, float8_linear.py: `matmul_with_hp_or_float8_args` saves
`input_hp` and `weight_hp_t`), so the saved activations are a bf16 run's. What it adds are the float8
copies one matmul casts while it computes, 1 B per element: its input and weight in forward, and in
backward also the output's gradient. The largest converted Linear's are billed with the overhead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ...float8_rule import converts_shape, float8_linear_names
from .model_spec import LlamaShape, ModelSpec
from .sizes import format_gib


@dataclass(frozen=True, kw_only=True)
class Float8Linears:
    """The Linears that train in float8: how many, and their distinct (in_features, out_features)."""

    count: int
    shapes: tuple[tuple[int, int], ...]

    def transient_bytes(self, tokens: int) -> int:
        """The float8 copies of the largest converted matmul of `tokens` tokens: input, output gradient, weight."""
        return max(tokens * (n_in + n_out) + n_in * n_out for n_in, n_out in self.shapes)

    def note(self, tokens: int) -> str:
        return (
            f"float8: {self.count} Linears train in float8 (float8_rule.py's rule); activations as in bf16 "
            f"(torchao's Float8Linear saves its bf16 input and weight), + {format_gib(self.transient_bytes(tokens))} "
            "GiB in overhead: the largest one's float8 input, weight and output gradient while it computes"
        )


def float8_linears(model: Any, spec: ModelSpec) -> Float8Linears:
    """What `convert_to_float8` would convert: a module's own Linears (`float8_linear_names`), else the
    Llama-shaped blocks of `spec` (the head never converts). ValueError when none would."""
    if isinstance(model, nn.Module):
        modules = dict(model.named_modules())
        shapes = [(modules[n].in_features, modules[n].out_features) for n in float8_linear_names(model)]
    elif spec.shape is not None:
        shapes = [s for s in _block_linears(spec.shape) if converts_shape(in_features=s[0], out_features=s[1])]
        shapes *= spec.shape.n_layers
    else:
        shapes = []
    if not shapes:
        raise ValueError(
            f"float8=True: no Linear of {spec.name} converts by float8_rule.py's rule (in and out features "
            "multiples of 16, both at least 1024, not the output head); estimate it with float8=False"
        )
    return Float8Linears(count=len(shapes), shapes=tuple(sorted(set(shapes))))


def _block_linears(shape: LlamaShape) -> list[tuple[int, int]]:
    """(in, out) of a Llama block's Linears: q, k, v, o projections, then gate, up, down."""
    q, kv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    dim, ffn = shape.dim, shape.ffn_dim
    return [(dim, q), (dim, kv), (dim, kv), (q, dim), (dim, ffn), (dim, ffn), (ffn, dim)]
