"""The memory estimate under tensor parallelism: what one tp rank holds of a Llama-style model.

With `tp` ranks per layer the TP-local model (heads, kv heads and ffn width divided by tp; norms
replicated) is billed as a model of its own, sharded over the `world / tp` data-parallel ranks, with a
note naming the collectives each block adds over tp. What divides and what stays whole:
docs/design.md, Note [Memory moments].
"""

from __future__ import annotations

from dataclasses import replace

from .model_spec import LlamaShape, ModelSpec


def _split(count: int, tp: int) -> int:
    return -(-count // tp)


def local_shape(shape: LlamaShape, *, tp: int) -> LlamaShape:
    """`shape` as one tp rank computes it: a share of the heads and of the ffn width."""
    if shape.n_kv_heads % tp:
        raise ValueError(
            f"tp={tp} does not divide the model's {shape.n_kv_heads} key/value heads: use a tp that divides "
            f"{shape.n_kv_heads} (each tp rank holds whole heads)"
        )
    return replace(
        shape, n_heads=shape.n_heads // tp, n_kv_heads=shape.n_kv_heads // tp, ffn_dim=_split(shape.ffn_dim, tp)
    )


def tp_local_spec(model: ModelSpec, *, tp: int) -> ModelSpec:
    """What one tp rank holds of `model` before sharding: split weights 1 / tp, norms whole."""
    if tp == 1:
        return model
    shape = model.shape
    if shape is None:
        raise ValueError(
            f"tp={tp}: the tensor-parallel estimate needs the model's shape; pass a Llama size, a config or "
            "the module, or shape hints (dim=, layers=, heads=, kv_heads=, ffn=, vocab=)"
        )
    if model.trainable_params < model.num_params:
        raise ValueError(f"tp={tp}: the tensor-parallel estimate of a fine-tune is not supported; estimate with tp=1")
    block_norms = 2 * shape.dim

    def local(count: int, norms: int) -> int:
        return _split(count - norms, tp) + norms

    units = tuple(local(u, block_norms if u == shape.block_params else 0) for u in model.unit_params)
    root = local(model.root_params, shape.dim)  # the final norm stays with the root
    total = root + sum(units)
    return replace(
        model,
        name=f"{model.name} (what 1 of {tp} tp ranks holds)",
        num_params=total,
        trainable_params=total,
        root_params=root,
        enclosing_params=root + model.enclosing_params - model.root_params,
        unit_params=units,
        shape=local_shape(shape, tp=tp),
        lookup_params=(),  # a split embedding is gathered, not looked up in place
        param_rows=(),  # the padding of the TP-local rows is not modelled
        root_trainable=None,
        enclosing_trainable=None,
        unit_trainable=None,
        notes=model.notes,
    )


def tp_collectives(*, tp: int, sequence_parallel: bool, tokens: int, dim: int, compute_bytes: int) -> str:
    """The line naming the collectives over tp that each block runs (module docstring)."""
    size = tokens * dim * compute_bytes / 2**20
    if sequence_parallel:
        kinds = "2 all-gathers + 2 reduce-scatters"
    else:
        kinds = "2 all-reduces"
    return (
        f"tensor parallel over {tp} ranks{' with sequence parallelism' if sequence_parallel else ''}: per block, "
        f"{kinds} over tp of {size:.1f} MiB each in forward, the same in backward"
    )
