"""Activation and loss memory of a Llama-style decoder on one device, in bytes.

Notation: T = micro_batch * seq_len tokens on the device, s = seq_len, h = dim, q = heads * head_dim
(= h in Llama), kv = kv_heads * head_dim, f = ffn_dim, V = vocab, c = bytes of the compute dtype
(the param dtype: 2 for bf16, 4 without mixed precision).

Saved for backward by one block without checkpointing, per token, in elements of c bytes:

    attention-norm input and output              2h
    q and k after rotary embedding, v            q + 2kv
    attention output, stored twice               2q   (by the kernel, and as the output projection's input)
    feed-forward-norm input and output           2h
    w1(x), w3(x), silu(w1(x)), their product     4f

so c * T * (4h + 3q + 2kv + 4f), i.e. s*b*[h*(14 + 4*kv_heads/heads) + 8*ffn] bytes in bf16, plus fp32
statistics (log-sum-exp, 4 bytes per head, and two RMSNorm reciprocal std, 8 bytes). Counting the
tensors once gives 12h; the second copy of the attention output adds 2h. The estimator's peaks
against measured ones: BENCHMARKS.md, 'Memory estimator against measured peaks (2 × H200)'.

In fp32 compute the flash / cuDNN kernels do not apply (they need 16-bit inputs; with grouped-query
attention the memory-efficient kernel does not either), so torch's math kernel stores the softmax
probabilities, 4 * heads * s bytes per token and block, and its backward allocates two more such
matrices.

Activation checkpointing keeps only each checkpointed block's input (c * T * h) and recomputes one
block's full activations at a time during backward, beside which that block's backward holds the
gradients of its three ffn-wide tensors (3 * c * T * f): measured on the CPU (tests/planning/cost), they are
what a small model's checkpointed peak lacked without them. Checkpointing every k-th block checkpoints blocks
0, k, 2k, ... (ceil(L / k) of them); the others save everything.

The final norm keeps its input and output (the head's input): 2 * c * T * h.

Tensor parallelism (planning/cost/tensor_parallel.py) bills the TP-local shape; sequence parallelism over
`sequence_split` ranks then divides what the norms keep and the checkpointed residual by that count,
while the projections' inputs, gathered along the sequence before them, stay whole.

A fine-tune with a frozen base saves less (`trained.TrainedParts`): a frozen projection's input is
kept only where something else needs it, so LoRA on q_proj and v_proj drops the second copy of the
attention output, the feed-forward-norm output, the final norm's output and the w2 input (q + h + f
per token and block), and adds its adapters' A outputs (rank per adapter). Hugging Face's RMSNorm
(`LlamaShape.hf_norms`) casts its input to fp32 and keeps that copy (4h bytes instead of c * h), and
with a trainable weight also the normalised input in the compute dtype (c * h).

The loss (`Llama.loss`: logits in the compute dtype, cast to fp32, cross-entropy) peaks in the
backward of log_softmax, when three fp32 tensors of T * V elements coexist: the saved log-probabilities,
the incoming gradient from nll_loss, and the gradient of the logits: 12 * T * V bytes. (The forward
holds 10 * T * V in bf16: logits, their fp32 copy, the log-probabilities.) This is what dominates small
models with a large vocabulary: 11.7 GiB at 1.5B, batch 2 x 4096, vocab 128,256. A training loop that
keeps its own reference to the logits until backward adds c * T * V.

The chunked loss (`st.chunked_cross_entropy`, train.chunked_loss) holds one chunk of R rows at a time,
R the rows whose logits match the hidden states in size (`default_chunk_rows`): the chunk's fp32 logits
and log-probabilities and the gradient cast to the compute dtype, (8 + c) * R * V; beside them the
hidden states' gradient it computes in forward, c * T * h; and when the head trains, the weight's
gradient accumulated in fp32 (4 * V * h) with, in a 16-bit compute dtype, each chunk's product and the
final cast (c * V * h). It wins where T * V outgrows those (`chunked_loss_wins`): at every length with
a frozen head (LoRA), and from about h / 2 tokens per micro-batch with a trained one.
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
