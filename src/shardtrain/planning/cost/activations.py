"""Activation and loss memory of a Llama-style decoder on one device, in bytes.

What one block saves for backward (with and without activation checkpointing, in fp32 or 16-bit
compute, split by tensor or sequence parallelism, with a frozen base), what the final norm keeps, and
the loss's peak, plain or chunked (`chunked_loss_wins`): the memory estimate's activation terms. The
per-tensor counts: docs/design.md, Note [Activation memory]; the estimate against measured peaks:
BENCHMARKS.md, 'Memory estimator against measured peaks (2 × H200)'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...models.chunked_ce import default_chunk_rows
from .model_spec import LlamaShape
from .trained import FULL_TRAINING, TrainedParts

FP32 = 4
LOSS_BYTES_PER_LOGIT = 3 * FP32


@dataclass(frozen=True, kw_only=True)
class ActivationBill:
    """Bytes for one micro-batch: what stays saved through forward, and what backward adds on top."""

    saved: int  # every block's saved tensors (or checkpoints) and the final norm's, at the end of forward
    backward_extra: int  # a checkpointed block's recomputation and the attention backward's temporaries
    loss_peak: int  # logits and cross-entropy tensors at their peak (backward of log_softmax)


def loss_bytes(*, tokens: int, dim: int, vocab: int, compute_bytes: int, head_trains: bool, chunked: bool) -> int:
    """The loss's peak bytes for `tokens` rows over a `vocab` (this rank's share under loss parallelism):
    full logits, or the chunked loss (module docstring)."""
    if not chunked:
        return LOSS_BYTES_PER_LOGIT * tokens * vocab
    rows = min(tokens, default_chunk_rows(rows=tokens, dim=dim, vocab=vocab))
    weight_grad = (FP32 + (compute_bytes if compute_bytes < FP32 else 0)) * vocab * dim if head_trains else 0
    return (2 * FP32 + compute_bytes) * rows * vocab + compute_bytes * tokens * dim + weight_grad


def chunked_loss_wins(*, tokens: int, dim: int, vocab: int, compute_bytes: int, head_trains: bool) -> bool:
    """Whether the chunked loss peaks lower than the full logits' for this micro-batch."""
    sizes: dict[str, Any] = {
        "tokens": tokens,
        "dim": dim,
        "vocab": vocab,
        "compute_bytes": compute_bytes,
        "head_trains": head_trains,
    }
    return loss_bytes(**sizes, chunked=True) < loss_bytes(**sizes, chunked=False)


def norm_input_bytes(shape: LlamaShape, *, compute_bytes: int, trained: TrainedParts) -> int:
    """Per token, what one RMSNorm keeps for backward: its input (an fp32 copy in Hugging Face's), and
    Hugging Face's the normalised input too when its weight trains."""
    if not shape.hf_norms:
        return compute_bytes * shape.dim
    return max(FP32, compute_bytes) * shape.dim + (compute_bytes * shape.dim if trained.norms else 0)


def block_bytes(
    shape: LlamaShape,
    *,
    tokens: int,
    seq_len: int,
    compute_bytes: int,
    trained: TrainedParts = FULL_TRAINING,
    sequence_split: int = 1,
) -> int:
    """What one block saves for backward without checkpointing (see the module docstring)."""
    q, kv, h, f = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim, shape.dim, shape.ffn_dim
    elements = (
        q
        + 2 * kv
        + q
        + 3 * f  # attention kernel: q, k, v, output; silu's input, both factors of the product
        + h * trained.attention_in  # the attention-norm output, input of q / k / v
        + q * trained.attention_out  # the attention output again, input of the output projection
        + h * trained.mlp_in  # the feed-forward-norm output, input of w1 / w3
        + f * trained.mlp_out  # the product, input of w2
        + trained.adapter_rank
    )
    norms = 2 * norm_input_bytes(shape, compute_bytes=compute_bytes, trained=trained) // sequence_split
    per_token = compute_bytes * elements + norms
    if compute_bytes >= FP32:
        per_token += attention_matrix_bytes(shape, seq_len=seq_len)
    else:
        per_token += FP32 * shape.n_heads + 2 * FP32
    return tokens * per_token


def attention_matrix_bytes(shape: LlamaShape, *, seq_len: int) -> int:
    """Per token: one fp32 row of softmax probabilities per head (math attention kernel)."""
    return FP32 * shape.n_heads * seq_len


def checkpointed_blocks(n_layers: int, every: int) -> int:
    """How many blocks recompute in backward when every `every`-th one is checkpointed (0: none)."""
    return 0 if every == 0 else -(-n_layers // every)


def activation_bill(
    shape: LlamaShape,
    *,
    micro_batch: int,
    seq_len: int,
    compute_bytes: int,
    recompute_every: int,
    trained: TrainedParts = FULL_TRAINING,
    sequence_split: int = 1,
    vocab_split: int = 1,
    chunked_loss: bool | str = False,
) -> ActivationBill:
    """`sequence_split`: the tp ranks sequence parallelism splits the norms and the residual over (1: none);
    `vocab_split`: the tp ranks loss parallelism splits the logits and the cross-entropy over (1: none);
    `chunked_loss`: the loss in chunks (`loss_bytes`); "auto": where that peaks lower (`chunked_loss_wins`)."""
    tokens = micro_batch * seq_len
    block = block_bytes(
        shape,
        tokens=tokens,
        seq_len=seq_len,
        compute_bytes=compute_bytes,
        trained=trained,
        sequence_split=sequence_split,
    )
    n_ckpt = checkpointed_blocks(shape.n_layers, recompute_every)
    checkpoint = compute_bytes * tokens * shape.dim // sequence_split
    final_norm = tokens * (
        norm_input_bytes(shape, compute_bytes=compute_bytes, trained=trained) // sequence_split
        + compute_bytes * shape.dim * trained.head
    )
    saved = (shape.n_layers - n_ckpt) * block + n_ckpt * checkpoint + final_norm
    # a checkpointed block's recomputed activations, and beside them its backward's gradients of the
    # three ffn-wide tensors (w1(x), w3(x), their product)
    extra = block + 3 * compute_bytes * tokens * shape.ffn_dim if n_ckpt else 0
    if compute_bytes >= FP32:
        extra += 2 * tokens * attention_matrix_bytes(shape, seq_len=seq_len)
    sizes: dict[str, Any] = {
        "tokens": tokens,
        "dim": shape.dim,
        "vocab": -(-shape.vocab_size // vocab_split),
        "compute_bytes": compute_bytes,
        "head_trains": trained.head,
    }
    chunked = chunked_loss_wins(**sizes) if chunked_loss == "auto" else bool(chunked_loss)
    loss = loss_bytes(**sizes, chunked=chunked)
    return ActivationBill(saved=saved, backward_extra=extra, loss_peak=loss)
