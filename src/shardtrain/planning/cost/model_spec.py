"""What the memory estimator needs to know about a model: its `ModelSpec` and Llama-style shape.

A `ModelSpec` holds the parameter counts per sharding unit, plus the Llama-style shape that the
activation formulas need (None when it cannot be known). The shape comes from a built-in size, a
`LlamaConfig`, a Hugging Face config or a parameter count with hints (here); a live module's spec
is read in `module_spec`, and `model_input.resolve_model` picks between them.

Missing shape hints are filled the way Llama-3 models are built: head dim 128, 8 key/value heads (or
the largest divisor of the head count up to 8), SwiGLU width round_up(1.3 * 8/3 * dim, 256), a
128,256-token vocabulary, untied embeddings, and (when neither dim nor layers is given) a width near
128 * layers, the depth/width ratio of Llama 3.2-1B and Llama 3-8B, rounded to a multiple of 1024
(256 below 2048), with the depth that then matches the count. Those defaults only shape the
activation and unit estimates; a parameter count the user gives is used as is for the model states.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ...models.llama_config import LlamaConfig, splits_embedding
from .sizes import format_count
from .trained import FULL_TRAINING, TrainedParts

DEFAULT_VOCAB = 128256


@dataclass(frozen=True, kw_only=True)
class LlamaShape:
    """The dimensions of a Llama-style decoder (RMSNorm, GQA attention, SwiGLU)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool = False
    hf_norms: bool = False  # Hugging Face's RMSNorm: computes in fp32 and keeps an fp32 copy of its input

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model shape: {name}={value!r} must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model shape: heads={self.n_heads} is not a multiple of kv_heads={self.n_kv_heads}; "
                "give kv_heads that divides heads"
            )

    @property
    def block_params(self) -> int:
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return self.dim * (2 * q + 2 * kv) + 3 * self.dim * self.ffn_dim + 2 * self.dim

    @property
    def root_params(self) -> int:
        """Embedding, final norm and output head: the parameters outside the blocks."""
        return self.vocab_size * self.dim * (1 if self.tie_embeddings else 2) + self.dim

    @property
    def num_params(self) -> int:
        return self.n_layers * self.block_params + self.root_params

    def describe(self) -> str:
        return (
            f"dim {self.dim}, {self.n_layers} layers, {self.n_heads} heads ({self.n_kv_heads} kv), "
            f"ffn {self.ffn_dim}, vocab {self.vocab_size}" + (", tied embeddings" if self.tie_embeddings else "")
        )


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Parameter counts per sharding unit and, when known, the shape for the activation formulas.

    `root_params` belong to the outermost unit, which is unsharded for the whole forward and the whole
    backward (its forward encloses every other unit's); `enclosing_params` is the largest sum of the
    units enclosing some inner unit (the root's, for a flat list of blocks); `unit_params` lists the
    inner units in plan order; `lookup_params` those of them that are a bare `nn.Embedding`, which,
    sharded over several ranks, look their rows up in place and are never gathered (`core.lookup`).
    """

    name: str
    num_params: int
    trainable_params: int
    root_params: int
    enclosing_params: int
    unit_params: tuple[int, ...]
    shape: LlamaShape | None
    lookup_params: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    param_rows: tuple[tuple[int, int, bool], ...] = ()  # per parameter: rows, elements per row, trainable
    trained: TrainedParts = FULL_TRAINING
    frozen_bytes: int | None = None
    quantized_base: bool = False  # the frozen linear layers are 4-bit (st.quantize_base): gathered as stored
    root_trainable: int | None = None
    enclosing_trainable: int | None = None
    unit_trainable: tuple[int, ...] | None = None

    @property
    def frozen_params(self) -> int:
        return self.num_params - self.trainable_params

    def trainable_of(self, part: str) -> int:
        """Trainable parameters of the root ('root'), of the units enclosing an inner unit ('enclosing'),
        or the most of any inner unit ('unit')."""
        if part == "unit":
            counts = self.unit_trainable if self.unit_trainable is not None else self.unit_params
            return max(counts, default=0)
        value = {"root": self.root_trainable, "enclosing": self.enclosing_trainable}[part]
        return value if value is not None else {"root": self.root_params, "enclosing": self.enclosing_params}[part]

    def padding(self, shard_size: int) -> tuple[int, int]:
        """(all, trainable) padding elements when every parameter's rows are padded to a multiple of
        `shard_size` (core.param_layout); 0 when the parameters' shapes are not known (a count or a shape)."""
        pads = [((-(-rows // shard_size) * shard_size - rows) * row, trains) for rows, row, trains in self.param_rows]
        return sum(p for p, _ in pads), sum(p for p, t in pads if t)

    def largest_units(self, count: int, *, lookups_gather: bool = True) -> int:
        """Parameters of the `count` largest inner units together; with `lookups_gather=False`, of the
        largest units that gather (an embedding that looks up in place holds no unsharded copy)."""
        sizes = list(self.unit_params)
        if not lookups_gather:
            for size in self.lookup_params:
                sizes.remove(size)
        return sum(sorted(sizes, reverse=True)[:count])


def _round_up(value: float, multiple: int) -> int:
    return int(-(-int(value) // multiple) * multiple)


def _default_ffn(dim: int) -> int:
    return _round_up(1.3 * int(8 * dim / 3), 256)


def _default_heads(dim: int) -> int:
    for head_dim in (128, 64):
        if dim % head_dim == 0:
            return dim // head_dim
    return 1


def shape_from_dims(dim: int, layers: int, hints: dict[str, Any]) -> LlamaShape:
    """A Llama shape of `dim` and `layers`, the other fields from `hints` or the Llama defaults."""
    heads = hints.get("heads") or _default_heads(dim)
    if dim % heads:
        raise ValueError(f"dim={dim} is not a multiple of heads={heads}; give heads that divides dim")
    kv_heads = hints.get("kv_heads") or max(d for d in range(1, min(8, heads) + 1) if heads % d == 0)
    return LlamaShape(
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=dim // heads,
        ffn_dim=hints.get("ffn") or _default_ffn(dim),
        vocab_size=hints.get("vocab") or DEFAULT_VOCAB,
        tie_embeddings=bool(hints.get("tie_embeddings") or False),
    )


def shape_for_count(params: int, hints: dict[str, Any]) -> LlamaShape:
    """Choose dim and layers (those not hinted) so that the Llama-style count comes closest to `params`."""
    dim, layers, heads = hints.get("dim"), hints.get("layers"), hints.get("heads")
    if heads and not dim and not layers:
        dim = 128 * heads  # Llama's head dim
    if dim and layers:
        return shape_from_dims(dim, layers, hints)
    if layers:
        step = heads or 64
        candidates = (shape_from_dims(d, layers, hints) for d in range(step, 65537, step))
        return min(candidates, key=lambda s: abs(s.num_params - params))
    if not dim:  # the depth that fits at dim = 128 * layers, then a round width (8 kv heads divide it)
        close = min(
            (shape_from_dims(128 * n, n, hints) for n in range(1, 257)), key=lambda s: abs(s.num_params - params)
        )
        granule = 1024 if close.dim >= 2048 else 256
        dim = max(granule, round(close.dim / granule) * granule)
    probe = shape_from_dims(dim, 1, hints)
    return replace(probe, n_layers=max(1, round((params - probe.root_params) / probe.block_params)))


def spec_from_shape(name: str, shape: LlamaShape, *, params: int | None = None, notes=()) -> ModelSpec:
    """Units of a Llama as the built-in Llama's `default_units` cuts it: one unit per block, and the embedding
    and the output head as units of their own with the final norm in the root when the table is at
    least a block's size (else, or with tied embeddings, all three are the root's)."""
    total = shape.num_params if params is None else params
    blocks = total - shape.root_params
    if blocks < shape.n_layers:
        raise ValueError(
            f"params={total:,} leaves nothing for {shape.n_layers} blocks after the embedding and head "
            f"({shape.root_params:,} parameters at vocab {shape.vocab_size}, dim {shape.dim}); "
            "give a larger parameter count or smaller vocab / dim hints"
        )
    notes = list(notes)
    if params is not None and abs(shape.num_params - params) > 0.1 * params:
        notes.append(
            f"the shape used for activations ({shape.describe()}) has {format_count(shape.num_params)} "
            f"parameters, not {format_count(params)}; give dim / layers hints that match"
        )
    block_units = (blocks // shape.n_layers,) * shape.n_layers
    table = shape.vocab_size * shape.dim
    lookups: tuple[int, ...]
    if shape.tie_embeddings or not splits_embedding(table_params=table, block_params=block_units[0]):
        root, units, lookups = shape.root_params, block_units, ()
    else:
        root, units, lookups = shape.dim, (table, *block_units, table), (table,)
    return ModelSpec(
        name=name,
        num_params=total,
        trainable_params=total,
        root_params=root,
        enclosing_params=root,
        unit_params=units,
        lookup_params=lookups,
        shape=shape,
        notes=tuple(notes),
    )


def shape_from_llama(cfg: LlamaConfig) -> LlamaShape:
    """The shape of a built-in Llama's config."""
    return LlamaShape(
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        ffn_dim=cfg.ffn_dim,
        vocab_size=cfg.vocab_size,
        tie_embeddings=cfg.tie_embeddings,
    )


def shape_from_hf(cfg: Any) -> LlamaShape:
    """The shape of a Llama-style Hugging Face config; ValueError naming the fields it lacks."""
    missing = [a for a in ("hidden_size", "num_hidden_layers", "vocab_size") if getattr(cfg, a, None) is None]
    if missing:
        raise ValueError(
            f"Hugging Face-style config {type(cfg).__name__} lacks {missing}; it needs hidden_size, "
            "num_hidden_layers, vocab_size (and optionally intermediate_size, num_attention_heads, "
            "num_key_value_heads, head_dim, tie_word_embeddings)"
        )
    dim = int(cfg.hidden_size)
    heads = int(getattr(cfg, "num_attention_heads", None) or _default_heads(dim))
    return LlamaShape(
        dim=dim,
        n_layers=int(cfg.num_hidden_layers),
        n_heads=heads,
        n_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or dim // heads),
        ffn_dim=int(getattr(cfg, "intermediate_size", None) or _default_ffn(dim)),
        vocab_size=int(cfg.vocab_size),
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        hf_norms=True,
    )


def apply_hints(shape: LlamaShape, hints: dict[str, Any]) -> LlamaShape:
    """Hints override the fields of a shape that came from a name or config."""
    fields = {
        "dim": "dim",
        "layers": "n_layers",
        "vocab": "vocab_size",
        "ffn": "ffn_dim",
        "heads": "n_heads",
        "kv_heads": "n_kv_heads",
        "tie_embeddings": "tie_embeddings",
    }
    changes = {fields[k]: v for k, v in hints.items() if v is not None}
    if not changes:
        return shape
    if "dim" in changes or "n_heads" in changes:
        changes.setdefault("n_heads", shape.n_heads)
        changes["head_dim"] = changes.get("dim", shape.dim) // changes["n_heads"]
    return replace(shape, **changes)
