"""The forward of packed batches: several documents per row, none attending to another.

A packed row holds documents back to back; `position_ids` restart at 0 where each begins.
`forward_logits` runs a model on such rows so that every document's logits equal those of the
document run alone, and `check_packing_supported` refuses, up front, the models that would silently
let tokens attend across documents: support is decided by what a model does, through
train/packing_probe.py's probe, and the verdict is kept per model. How each kind of model is called
and what is refused without a forward: docs/design.md, Note [Packed forward]; speed: BENCHMARKS.md,
'Fine-tuning on a packed chat dataset against pre-tokenised windows (1 × H200)'.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from torch import nn

from ..pretrained.keys import hf_model
from .packing_probe import PackingProbe, probe_packing

__all__ = ["check_packing_static", "check_packing_supported", "forward_logits", "use_block_sparse_attention"]

_FIX = "train unpacked: --data.packing false"
# model -> (the transformers model inside it, its attn_implementation when probed, the probe)
_VERDICTS: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module | None, str | None, PackingProbe]] = (
    weakref.WeakKeyDictionary()
)


def forward_logits(model: nn.Module, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Logits (batch, seq, vocab) of `model` on `input_ids`.

    With `position_ids` (same shape, restarting at 0 at each document): of packed rows, every
    document alone (module docstring); the model is checked first (`check_packing_supported`: the
    first time, a probe forward on every rank). Without: the model's ordinary forward. A
    transformers model always runs with `use_cache=False` (no cache is wanted while training, and
    a cache would turn packed detection off).
    """
    if position_ids is not None:
        if position_ids.shape != input_ids.shape:
            raise ValueError(
                f"position_ids of shape {tuple(position_ids.shape)} for input_ids of shape "
                f"{tuple(input_ids.shape)}; give one position per token"
            )
        check_packing_supported(model, device=input_ids.device)
    return _logits(model, input_ids, position_ids)


def check_packing_static(model: nn.Module) -> None:
    """Raise a one-line ValueError if `model` certainly cannot keep packed documents apart, without
    running it (a model on the meta device is fine): transformers' flash_attention_*, or a forward
    without a `position_ids` parameter (**kwargs does not count). Passing says nothing yet:
    `check_packing_supported` decides."""
    hf = hf_model(model)
    target = model if hf is None else hf
    name = type(target).__name__
    impl = None if hf is None else getattr(hf.config, "_attn_implementation", None)
    if str(impl).startswith("flash_attention"):
        raise ValueError(
            f"{name} with attn_implementation={impl!r} separates packed documents only in a batch of one row, "
            f"so packed batches would leak: load it with attn_implementation='sdpa' (or 'eager', "
            f"'flex_attention') or {_FIX}"
        )
    if "position_ids" not in inspect.signature(target.forward).parameters:
        raise ValueError(
            f"{name}.forward takes no position_ids, so packed documents would attend to each other: {_FIX}"
        )


def check_packing_supported(model: nn.Module, *, device: torch.device) -> None:
    """Return if `model` keeps packed documents apart under `forward_logits`, else raise a one-line
    ValueError naming the model, what was measured and the fix.

    The first call for a model (or after its attn_implementation changed) runs the probe, a no-grad
    forward on `device`: on a sharded model every rank must call it at the same point. Later calls
    look the verdict up.
    """
    known = _VERDICTS.get(model)
    if known is not None:
        hf, impl, probe = known
        if hf is None or getattr(hf.config, "_attn_implementation", None) == impl:
            if not probe.keeps_documents_apart:
                raise ValueError(probe.refusal())
            return
    check_packing_static(model)
    hf = hf_model(model)
    embedding = _first_embedding(model) if hf is None else hf.get_input_embeddings()
    probe = probe_packing(
        model,
        lambda ids, positions: _logits(model, ids, positions),
        name=type(model if hf is None else hf).__name__,
        vocab_size=embedding.num_embeddings,
        device=device,
    )
    _VERDICTS[model] = (hf, None if hf is None else getattr(hf.config, "_attn_implementation", None), probe)
    if not probe.keeps_documents_apart:
        raise ValueError(probe.refusal())


def _logits(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    if hf_model(model) is not None:
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    elif position_ids is None:
        out = model(input_ids)
    else:
        out = model(input_ids, position_ids=position_ids)
    return getattr(out, "logits", out)


def _first_embedding(model: nn.Module) -> nn.Embedding:
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError(
            f"{type(model).__name__} has no nn.Embedding, so no token ids can be drawn to test whether it keeps "
            f"packed documents apart: {_FIX}"
        )
    return embedding


def use_block_sparse_attention(model: nn.Module, *, device: torch.device) -> str | None:
    """Switch a transformers `model` at "sdpa" to "flex_attention" for packed rows on CUDA.

    Why: with packed `position_ids` transformers gives sdpa a dense block-diagonal mask, which takes
    sdpa off its flash kernel (BENCHMARKS.md, 'Fine-tuning on a packed chat dataset'); flex_attention's
    BlockMask skips the blocks across documents instead. Returns a notice
    for the log, or None when nothing changed (the built-in Llama picks its own kernel; another
    implementation, or any on the CPU, is kept: flex_attention unfused materialises every score).
    Call it only when the user did not name an attn_implementation.
    """
    hf = hf_model(model)
    if device.type != "cuda" or hf is None or getattr(hf.config, "_attn_implementation", None) != "sdpa":
        return None
    hf.set_attn_implementation("flex_attention")
    return (
        f"{type(hf).__name__} attends with flex_attention for packed rows (sdpa's dense document mask leaves "
        "its flash kernel); pass --model.kwargs.attn_implementation sdpa to keep sdpa"
    )
