"""`st.chunked_cross_entropy`: the cross-entropy of a linear head without holding its logits.

The whole [tokens, vocab] logits of a large vocabulary outgrow a LoRA step's activations, so the rows
go through in chunks whose gradients are computed in forward and only scaled in backward (nothing of
the weight is saved); value and gradients equal `F.cross_entropy` over the full logits to fp32
rounding. On CUDA, `backend="auto"` runs Liger's fused kernel when installed. How each chunk is
computed, and where the sums differ: docs/design.md, Note [Chunked cross-entropy].
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

__all__ = ["chunked_cross_entropy", "default_chunk_rows", "fused_kernel"]

BACKENDS = ("auto", "torch", "liger")
REDUCTIONS = ("sum", "mean")


def default_chunk_rows(*, rows: int, dim: int, vocab: int) -> int:
    """Rows per chunk such that a chunk's logits hold about as many elements as the hidden states
    (Liger's rule: rows / ceil(vocab / dim), rounded up to a power of two)."""
    wanted = max(1, math.ceil(rows / math.ceil(vocab / dim)))
    return 1 << (wanted - 1).bit_length()


@functools.cache
def fused_kernel() -> Callable | None:
    """Liger's `liger_fused_linear_cross_entropy` when liger_kernel imports, else None."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return liger_fused_linear_cross_entropy


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    ignore_index: int = -100,
    reduction: str = "sum",
    backend: str = "auto",
) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, ignore_index=, reduction=)` in fp32,
    without the [rows, vocab] logits (module docstring).

    hidden (..., dim) and labels (...) of the same leading shape; weight (vocab, dim), bias (vocab,).
    `chunk_rows`: rows per chunk (None: `default_chunk_rows`). `reduction`: "sum" or "mean" (over the
    labels that are not `ignore_index`; NaN when there are none, as in F.cross_entropy). `backend`:
    "torch" (the chunks here), "liger" (its fused kernel; CUDA only) or "auto" (liger on CUDA when
    installed, else torch).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not supported: use one of {', '.join(REDUCTIONS)}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown: use one of {', '.join(BACKENDS)}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden of shape {tuple(hidden.shape)} and labels of shape {tuple(labels.shape)}: give one label per "
            "row of hidden (labels of shape hidden.shape[:-1])"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} does not project hidden states of width {hidden.shape[-1]}: "
            "give the head's (vocab, dim) weight"
        )
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} is invalid: use 1 or more rows, or None for the default")
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    kernel = _pick(backend, hidden)
    if kernel is not None:
        accum = torch.float32 if weight.requires_grad else None
        loss = kernel(
            flat_hidden.contiguous(),
            weight,
            flat_labels,
            bias,
            ignore_index=ignore_index,
            reduction=reduction,
            accum_dtype=accum,
        )
        return loss.float()
    rows = chunk_rows or default_chunk_rows(rows=flat_hidden.shape[0], dim=weight.shape[1], vocab=weight.shape[0])
    loss = _ChunkedLinearCrossEntropy.apply(
        flat_hidden, weight, bias, flat_labels, rows, ignore_index, torch.is_grad_enabled()
    )
    if reduction == "mean":
        return loss / (flat_labels != ignore_index).sum()
    return loss


def _pick(backend: str, hidden: torch.Tensor) -> Callable | None:
    if backend == "torch" or (backend == "auto" and hidden.device.type != "cuda"):
        return None
    kernel = fused_kernel()
    if backend == "liger" and (kernel is None or hidden.device.type != "cuda"):
        raise ValueError(
            "backend='liger' needs liger_kernel and CUDA tensors: pip install 'shardtrain[liger]' on a CUDA "
            "machine, or use backend='torch'"
        )
    return kernel


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The summed loss; its forward also computes the wanted gradients, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_rows: int, ignore_index: int, grad_enabled: bool):
        # Note: needs_input_grad says True under no_grad too; without grad mode no gradient is computed
        want_hidden, want_weight, want_bias = (grad_enabled and wanted for wanted in ctx.needs_input_grad[:3])
        want_bias = want_bias and bias is not None
        grads_wanted = want_hidden or want_weight or want_bias
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = hidden[start : start + chunk_rows]
            kept = labels[start : start + chunk_rows] != ignore_index
            targets = labels[start : start + chunk_rows].where(kept, 0).unsqueeze(1)
            logits = F.linear(rows, weight, bias).float()
            log_probs = logits.log_softmax(dim=-1)
            del logits
            loss -= log_probs.gather(1, targets).squeeze(1).where(kept, 0.0).sum()
            if not grads_wanted:
                continue
            # d loss / d logits: softmax minus the one-hot target, zero on ignored rows
            grad_logits = log_probs.exp_()
            grad_logits.scatter_add_(1, targets, torch.full_like(targets, -1, dtype=grad_logits.dtype))
            grad_logits.mul_(kept.unsqueeze(1))
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start : start + chunk_rows])
            if grad_weight is not None:
                if rows.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), rows)
                else:
                    grad_weight += grad_logits.t() @ rows
        ctx.grads = (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
        )
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, grad_bias = ctx.grads
        ctx.grads = None  # each stored gradient is handed out once, scaled in place
        scaled = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in (grad_hidden, grad_weight, grad_bias)]
        return *scaled, None, None, None, None


@contextlib.contextmanager
def head_returns_loss(head: torch.nn.Linear, labels: torch.Tensor) -> Iterator[list[torch.Tensor]]:
    """Within the block, calling `head` (an nn.Linear) on hidden states returns their summed cross-entropy
    against `labels` (`chunked_cross_entropy`) instead of the logits; the list collects what each call
    returned.

    Why swap the instance's `forward` rather than subclass it: the call still goes through the module, so a
    head that is a sharding unit has its weight gathered around it and its gradient reduced; and the class
    keeps nn.Linear's own forward, which torch.compile of a whole model steps over without a frame of its own.
    """
    returned: list[torch.Tensor] = []

    def loss(hidden: torch.Tensor) -> torch.Tensor:
        returned.append(chunked_cross_entropy(hidden, head.weight, labels, bias=head.bias))
        return returned[-1]

    head.forward = loss  # type: ignore[method-assign,assignment]
    try:
        yield returned
    finally:
        del head.forward
