"""The forward of packed batches: several documents per row, none attending to another.

A packed row holds documents back to back; `position_ids` restart at 0 where each begins.
`forward_logits` runs a model on such rows so that every document's logits equal those of the
document run alone, and `check_packing_supported` refuses, up front, the models that would
silently let tokens attend across documents.

Supported, and why:
- the built-in Llama: `Llama.forward(tokens, position_ids=...)` builds a document mask once per
  forward (sdpa's block-diagonal boolean mask, or flex_attention's BlockMask on CUDA, which skips
  the blocks across documents: BENCHMARKS.md, 'Fine-tuning on a packed chat dataset').
- transformers models (a peft model around one too) with attn_implementation "sdpa", "eager" or
  "flex_attention": their mask builder (`transformers.masking_utils`) detects packed rows from
  `position_ids` (a new document wherever the position does not grow by one) and makes the mask
  block-diagonal, but only when the forward gets no `attention_mask` and no cache. So the forward
  gets `input_ids`, `position_ids`, `use_cache=False` and never an `attention_mask` (an all-ones
  mask leaks too). "sdpa" and "eager" then attend through a dense (batch, 1, seq, seq) mask, so
  sdpa leaves its flash kernel; "flex_attention" skips the blocks across documents. So on CUDA a
  model left at the default "sdpa" is switched to "flex_attention" for packed training
  (`use_block_sparse_attention`); an attn_implementation the user chose is kept.

Refused: transformers' flash_attention_2/3/4 (they find packed documents from `position_ids` only in
a batch of one row; in larger batches a row's documents attend to each other), any other or
custom attention (`masking_utils` builds no mask for it), a transformers version without
`masking_utils.find_packed_sequence_indices`, a model whose modeling code builds its masks without
`masking_utils` (remote code, say), a forward without `position_ids`, and any other model (nothing
tells what it does with `position_ids`).
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

from ..models.llama import Llama
from ..pretrained.keys import hf_model

__all__ = ["PACKED_HF_ATTENTION", "check_packing_supported", "forward_logits", "use_block_sparse_attention"]

# The attention implementations whose masks transformers builds block-diagonal from packed position_ids.
PACKED_HF_ATTENTION = ("sdpa", "eager", "flex_attention")
# The masking_utils functions a modeling module calls when its masks detect packed position_ids.
_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")
_FIX = "load the model with attn_implementation='sdpa' (or 'eager', 'flex_attention') or turn packing off"


def forward_logits(model: nn.Module, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Logits (batch, seq, vocab) of `model` on `input_ids`.

    With `position_ids` (same shape, restarting at 0 at each document): of packed rows, every
    document alone (module docstring); the model is checked first (`check_packing_supported`).
    Without: the model's ordinary forward. A transformers model always runs with `use_cache=False`
    (no cache is wanted while training, and a cache would turn packed detection off).
    """
    if position_ids is not None:
        if position_ids.shape != input_ids.shape:
            raise ValueError(
                f"position_ids of shape {tuple(position_ids.shape)} for input_ids of shape "
                f"{tuple(input_ids.shape)}; give one position per token"
            )
        check_packing_supported(model)
    if hf_model(model) is not None:
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    elif position_ids is None:
        out = model(input_ids)
    else:
        out = model(input_ids, position_ids=position_ids)
    return getattr(out, "logits", out)


def check_packing_supported(model: nn.Module) -> None:
    """Return if `model` keeps packed documents apart under `forward_logits`, else raise a one-line
    ValueError naming the model, its attention and the fix."""
    if any(isinstance(m, Llama) for m in model.modules()):
        return
    hf = hf_model(model)
    if hf is None:
        raise ValueError(
            f"packed batches need a model that keeps documents apart; {type(model).__name__} is neither the "
            "built-in Llama nor a transformers model, so nothing tells that it does: turn packing off"
        )
    name = type(hf).__name__
    impl = getattr(hf.config, "_attn_implementation", None)
    if impl not in PACKED_HF_ATTENTION:
        why = (
            "separates packed documents only for a batch of one row"
            if str(impl).startswith("flash_attention")
            else "gets no document mask from transformers"
        )
        raise ValueError(f"{name} with attn_implementation={impl!r} {why}, so packed batches would leak: {_FIX}")
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        version = getattr(sys.modules.get("transformers"), "__version__", "?")
        raise ValueError(
            f"transformers {version} does not detect packed documents from position_ids ({name} would attend "
            "across them): upgrade transformers (5.x does) or turn packing off"
        )
    modeling = vars(sys.modules.get(type(hf).__module__, object()))
    if not any(builder in modeling for builder in _MASK_BUILDERS):
        raise ValueError(
            f"{name} (from {type(hf).__module__}) does not build its masks with transformers.masking_utils, so "
            "nothing separates packed documents: turn packing off"
        )
    if "position_ids" not in inspect.signature(hf.forward).parameters:
        raise ValueError(f"{name}.forward takes no position_ids, so packed batches would leak: turn packing off")


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
