"""A fine-tune described without a live model: LoRA adapters on a frozen base, or a trainable fraction.

`fine_tune_spec` turns a model known by its shape (a built-in size, a config, a parameter count) into
what a fine-tune of it holds, so the estimator and the automatic plan bill the frozen base without
gradients or optimizer state (docs/pretrained.md, "Planning a fine-tune"); how LoRA, a 4-bit base
(`base_bits=4`) and `trainable_fraction` are counted: docs/design.md, Note [Fine-tune specs]. A live
model (an nn.Module, such as a peft model) already says what trains through `requires_grad`, so these
apply only to the other forms.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .model_spec import LlamaShape, ModelSpec
from .trained import ATTENTION_OUT, FULL_TRAINING, MLP_IN, MLP_OUT, check_targets, lora_parts

# in + out features of each projection, by the dimension names of `adapter_params`
_FEATURES = {
    **dict.fromkeys(("q_proj", "wq"), ("h", "q")),
    **dict.fromkeys(("k_proj", "wk", "v_proj", "wv"), ("h", "kv")),
    **dict.fromkeys(ATTENTION_OUT, ("q", "h")),
    **dict.fromkeys(MLP_IN, ("h", "f")),
    **dict.fromkeys(MLP_OUT, ("f", "h")),
}


NF4_BYTES = 0.5 + 1 / 64 + 2 / (64 * 256)


def adapter_params(shape: LlamaShape, *, rank: int, targets: tuple[str, ...]) -> int:
    """LoRA parameters of one block: rank * (in + out) per target projection."""
    dims = {
        "q": shape.n_heads * shape.head_dim,
        "kv": shape.n_kv_heads * shape.head_dim,
        "h": shape.dim,
        "f": shape.ffn_dim,
    }
    return sum(rank * (dims[_FEATURES[t][0]] + dims[_FEATURES[t][1]]) for t in targets)


def _from_live_model(spec: ModelSpec) -> bool:
    return bool(spec.param_rows)


def fine_tune_spec(
    spec: ModelSpec,
    *,
    lora_rank: int | None = None,
    lora_targets: Any = ("q_proj", "v_proj"),
    trainable_fraction: float | None = None,
    base_bits: int = 16,
) -> ModelSpec:
    """`spec` as the fine-tune described (module docstring); `spec` itself when neither is given."""
    if base_bits not in (4, 16):
        raise ValueError(f"base_bits={base_bits!r}: use 16 (the base as built) or 4 (an NF4 base, QLoRA)")
    if base_bits == 4 and lora_rank is None:
        raise ValueError("base_bits=4 quantises the frozen base under LoRA adapters; give lora_rank= with it")
    if lora_rank is None and trainable_fraction is None:
        return spec
    if lora_rank is not None and trainable_fraction is not None:
        raise ValueError(
            f"lora_rank={lora_rank} and trainable_fraction={trainable_fraction} both say what trains; give one"
        )
    if _from_live_model(spec):
        raise ValueError(
            f"{spec.name} is a live model, whose requires_grad already says what trains; apply LoRA to it "
            "(peft's get_peft_model) or freeze its parameters instead of passing lora_rank= / trainable_fraction="
        )
    if lora_rank is not None:
        tuned = _lora(spec, lora_rank, lora_targets)
        return _four_bit(tuned) if base_bits == 4 else tuned
    return _fraction(spec, trainable_fraction)


def _four_bit(spec: ModelSpec) -> ModelSpec:
    """`spec` (a LoRA fine-tune with a shape) with its blocks' linear layers billed in NF4, the rest in 16 bits."""
    shape = spec.shape
    assert shape is not None  # _lora needs it
    q, kv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    linear = shape.n_layers * (shape.dim * (2 * q + 2 * kv) + 3 * shape.dim * shape.ffn_dim)
    frozen = spec.frozen_params
    return replace(
        spec,
        name=f"{spec.name}, 4-bit base",
        frozen_bytes=round(linear * NF4_BYTES + (frozen - linear) * 2),
        quantized_base=True,
        notes=(*spec.notes, f"{linear:,} base parameters in NF4 ({NF4_BYTES:.3f} B each), the rest in 16 bits"),
    )


def _lora(spec: ModelSpec, rank: Any, targets: Any) -> ModelSpec:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_rank={rank!r} must be a positive integer such as 8")
    if isinstance(targets, str):
        targets = targets.split(",")
    targets = check_targets(tuple(targets))
    if spec.shape is None:
        raise ValueError(f"lora_rank={rank} needs the model's shape to size the adapters; {spec.name} has none")
    shape = spec.shape
    per_block = adapter_params(shape, rank=rank, targets=targets)
    # the blocks among the units: all of them, or all but the embedding and head (`model_spec.spec_from_shape`)
    first = len(spec.unit_params) - shape.n_layers
    block_units = range(first // 2, first // 2 + shape.n_layers) if first in (0, 2) else range(0)
    adapters = per_block * shape.n_layers
    unit_params = tuple(size + per_block * (i in block_units) for i, size in enumerate(spec.unit_params))
    return replace(
        spec,
        name=f"{spec.name}, LoRA r={rank} on {','.join(targets)}",
        num_params=spec.num_params + adapters,
        trainable_params=adapters,
        root_params=spec.root_params + (0 if block_units else adapters),
        enclosing_params=spec.enclosing_params + (0 if block_units else adapters),
        unit_params=unit_params,
        root_trainable=0 if block_units else adapters,
        enclosing_trainable=0 if block_units else adapters,
        unit_trainable=tuple(per_block * (i in block_units) for i in range(len(unit_params))),
        trained=lora_parts(targets, rank=rank),
        frozen_bytes=None,
        notes=(*spec.notes, f"{adapters:,} LoRA parameters train (fp32 masters, AdamW state); the base is frozen"),
    )


def _fraction(spec: ModelSpec, fraction: Any) -> ModelSpec:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"trainable_fraction={fraction!r} must be a share in (0, 1], e.g. 0.01")
    share = float(fraction)
    return replace(
        spec,
        name=f"{spec.name}, {share:.3g} of it trainable",
        trainable_params=round(share * spec.num_params),
        root_trainable=round(share * spec.root_params),
        enclosing_trainable=round(share * spec.enclosing_params),
        unit_trainable=tuple(round(share * size) for size in spec.unit_params),
        trained=FULL_TRAINING,
        frozen_bytes=None,
        notes=(
            *spec.notes,
            f"{share:.3g} of every unit trainable: activations as in full training (which layers train is not known)",
        ),
    )
