"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention through
`scaled_dot_product_attention`, SwiGLU feed-forward, optional tied input/output embeddings.

Sizes are registered by name in `LLAMA_SIZES` (from a few million parameters to 8B and beyond).

Packed batches: `forward(tokens, position_ids=...)` treats each run of a row that starts at
position 0 as a document of its own. Rotary embeddings take each token's position from
`position_ids`, and attention is causal within a document and blind across documents, through
a document mask built once per forward and handed to every block (`PackedAttention` says which
kernel). Without `position_ids` the forward is the plain causal one (`is_causal=True`).
"""

from __future__ import annotations

import enum
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from .chunked_ce import head_returns_loss
from .llama_config import LLAMA_SIZES, LlamaConfig, flops_per_token, llama_config, splits_embedding

__all__ = [
    "LLAMA_SIZES",
    "SHARD_UNITS",
    "Block",
    "Embedding",
    "Llama",
    "LlamaConfig",
    "OutputHead",
    "PackedAttention",
    "RMSNorm",
    "default_units",
    "document_mask",
    "flops_per_token",
    "llama_config",
    "rotary_tables",
    "splits_embedding",
]


class Embedding(nn.Embedding):
    """Token embedding initialised at std 0.02 (nn.Embedding's std 1 explodes tied logits)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary_tables(cfg: LlamaConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim)
    )
    t = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (first half, second half).
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class PackedAttention(enum.Enum):
    """How a block attends within the documents of a packed batch.

    MASK: `scaled_dot_product_attention` with a block-diagonal causal boolean mask of shape
    (batch, 1, seq, seq); any device, memory quadratic in seq (one byte per pair, shared by all layers).
    FLEX: `flex_attention` with a document `BlockMask`, compiled into a fused kernel that skips the
    blocks across documents; the default on CUDA (unfused and slow elsewhere, no CPU backward). It is
    a graph break in a compiled block (`_flex`), so a block compiled with fullgraph=True needs MASK.
    FLEX is the faster on a GPU (BENCHMARKS.md, 'Fine-tuning on a packed chat dataset': the packed
    8B fine-tune with transformers' flex path against its dense boolean mask).
    """

    MASK = "mask"
    FLEX = "flex"

    @classmethod
    def for_device(cls, device: torch.device) -> PackedAttention:
        return cls.FLEX if device.type == "cuda" else cls.MASK


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


@torch._dynamo.disable
def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, *, gqa: bool) -> torch.Tensor:
    """flex_attention, compiled once per process on CUDA (eager flex materialises every score).

    Note: kept out of compiled blocks' graphs (a graph break): torch 2.11's inductor, tracing flex
    inside an activation-checkpointed block, computed wrong attention (the loss 0.02 off at the first
    step, tests/models_llama); the block's other operations still compile.
    """
    attend = _compiled_flex() if q.device.type == "cuda" else flex_attention
    return attend(q, k, v, block_mask=mask, enable_gqa=gqa)


def document_mask(position_ids: torch.Tensor, kind: PackedAttention) -> torch.Tensor | BlockMask:
    """The attention mask of packed rows: token q sees token k iff k <= q in the same document.

    A document starts wherever `position_ids` is 0 (tokens before a row's first 0 form one more).
    MASK gives a boolean (batch, 1, seq, seq) tensor (True: attend), FLEX a `BlockMask`.
    """
    doc = (position_ids == 0).cumsum(-1)
    batch, seq = doc.shape
    if kind is PackedAttention.FLEX:

        def same_document(b, h, q, k):
            return (doc[b, q] == doc[b, k]) & (k <= q)

        return create_block_mask(same_document, batch, None, seq, seq, device=doc.device)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc.device).tril()
    return ((doc.unsqueeze(2) == doc.unsqueeze(1)) & causal).unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kv = cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv, bias=False)
        self.wv = nn.Linear(cfg.dim, kv, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | BlockMask | None = None
    ) -> torch.Tensor:
        """`mask` None: one causal sequence per row, `cos`/`sin` the whole tables. Otherwise packed
        documents: `cos`/`sin` per token (batch, 1, seq, head_dim / 2) and `document_mask`'s mask."""
        b, s, _ = x.shape
        c = self.cfg
        gqa = c.n_heads != c.n_kv_heads
        # Note: -1 heads, not n_heads: under tensor parallelism each rank holds a share of the heads
        q = self.wq(x).view(b, s, -1, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, c.head_dim).transpose(1, 2)
        if mask is None:
            q, k = apply_rotary(q, cos[:s], sin[:s]), apply_rotary(k, cos[:s], sin[:s])
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if isinstance(mask, BlockMask):
                out = _flex(q, k, v, mask, gqa=gqa)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | BlockMask | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.ffn(self.ffn_norm(x))


class OutputHead(nn.Linear):
    """The projection to the vocabulary: an nn.Linear with a class of its own, so that a wrap policy
    can make it a unit without making every Linear one. `Llama.forward(labels=)` calls it to return the
    summed cross-entropy in chunks instead (`head_returns_loss`): a head that is a sharding unit has its
    weight gathered around that call and its gradient reduced like any unit's."""


# One sharding unit per Block, and the embedding and the output head apart from the root: each is as
# large as several blocks (at 8B: 525M parameters against 218M), so the step starts by gathering the
# embedding alone and the head's gradient is reduced while the blocks' backward runs (torchtitan
# wraps Llama the same way).
SHARD_UNITS = frozenset({Block, Embedding, OutputHead})


def default_units(cfg: LlamaConfig) -> frozenset[type[nn.Module]]:
    """The sharding units `shardtrain train`, `shardtrain plan` and the estimator give a built-in Llama."""
    split = splits_embedding(table_params=cfg.vocab_size * cfg.dim, block_params=cfg.block_params)
    return SHARD_UNITS if split else frozenset({Block})


class Llama(nn.Module):
    """Returns logits of shape (batch, seq, vocab), or with `labels` the summed cross-entropy without
    them (`OutputHead`); `loss(tokens, targets)` gives the mean cross-entropy over the full logits.

    `packed_attention` picks the kernel of packed batches (None: `PackedAttention.for_device`).
    """

    packed_attention: PackedAttention | None = None
    rope_cos: torch.Tensor  # buffers (reset_parameters)
    rope_sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = OutputHead(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rotary_tables(cfg, device=self.embed.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def default_units(self) -> frozenset[type[nn.Module]]:
        """The sharding units the planner and `shardtrain train` give this model (`default_units`)."""
        return default_units(self.cfg)

    def reset_parameters(self) -> None:
        """Initialise this module's own state (the rotary tables); submodules initialise themselves."""
        cos, sin = rotary_tables(self.cfg, device=self.rope_cos.device)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(
        self, tokens: torch.Tensor, *, position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of `tokens` (batch, seq); with `position_ids` (same shape), of packed documents
        (module docstring): no token attends to another document's. With `labels` (same shape, already
        shifted, -100 where nothing trains): the fp32 cross-entropy summed over the trained labels,
        computed in chunks without the logits."""
        x = self.embed(tokens)
        # Note: the head is called inline, not in a helper: under torch.compile(model) a graph break at a
        # unit's hooks would otherwise resume in one more frame. Without labels it is called as before
        # (tensor-parallel styles hook that call); with them it returns the loss (head_returns_loss).
        if position_ids is None:
            for layer in self.layers:
                x = layer(x, self.rope_cos, self.rope_sin)
            if labels is None:
                return self.head(self.norm(x))
            with head_returns_loss(self.head, labels):
                return self.head(self.norm(x))
        if position_ids.shape != tokens.shape:
            raise ValueError(
                f"position_ids of shape {tuple(position_ids.shape)} for tokens of shape {tuple(tokens.shape)}; "
                "give one position per token"
            )
        kind = self.packed_attention or PackedAttention.for_device(tokens.device)
        mask = document_mask(position_ids, kind)
        cos, sin = self.rope_cos[position_ids].unsqueeze(1), self.rope_sin[position_ids].unsqueeze(1)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        if labels is None:
            return self.head(self.norm(x))
        with head_returns_loss(self.head, labels):
            return self.head(self.norm(x))

    def loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, *, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        # unpacked rows call forward(tokens) alone, so subclasses with the one-argument forward keep working
        logits = self(tokens) if position_ids is None else self(tokens, position_ids=position_ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
