"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention through
`scaled_dot_product_attention`, SwiGLU feed-forward, optional tied input/output embeddings.

Sizes are registered by name in `LLAMA_SIZES` (from a few million parameters to 8B and beyond).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 688
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig: dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def block_params(self) -> int:
        kv = self.n_kv_heads * self.head_dim
        return self.dim * (self.dim * 2 + kv * 2) + 3 * self.dim * self.ffn_dim + 2 * self.dim

    def num_params(self, *, include_embedding: bool = True) -> int:
        emb = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * self.block_params + self.dim + head + (emb if include_embedding else 0)


LLAMA_SIZES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, max_seq_len=128),
    "2m": LlamaConfig(vocab_size=256, dim=192, n_layers=4, n_heads=6, n_kv_heads=2, ffn_dim=512, max_seq_len=256),
    "7m": LlamaConfig(vocab_size=256, dim=320, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=864, max_seq_len=256),
    "34m": LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, max_seq_len=256),
    "125m": LlamaConfig(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, max_seq_len=2048),
    "1.5b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=8192, max_seq_len=4096, rope_theta=500000.0),
    "8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=4096, rope_theta=500000.0),
    "12b": LlamaConfig(vocab_size=128256, dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=13824, max_seq_len=4096, rope_theta=500000.0),
    "14b": LlamaConfig(vocab_size=128256, dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_dim=13824, max_seq_len=4096, rope_theta=500000.0),
    "18b": LlamaConfig(vocab_size=128256, dim=6144, n_layers=44, n_heads=48, n_kv_heads=8, ffn_dim=16384, max_seq_len=4096, rope_theta=500000.0),
    "30b": LlamaConfig(vocab_size=128256, dim=6656, n_layers=60, n_heads=52, n_kv_heads=4, ffn_dim=17920, max_seq_len=4096, rope_theta=500000.0),
}


def llama_config(name: str, **overrides) -> LlamaConfig:
    key = name.lower()
    if key not in LLAMA_SIZES:
        raise ValueError(f"unknown Llama size {name!r}; built-in sizes are {list(LLAMA_SIZES)}")
    return replace(LLAMA_SIZES[key], **overrides)


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
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim))
    t = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (first half, second half).
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kv = cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv, bias=False)
        self.wv = nn.Linear(cfg.dim, kv, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.cfg
        q = self.wq(x).view(b, s, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos[:s], sin[:s]), apply_rotary(k, cos[:s], sin[:s])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.n_heads != c.n_kv_heads)
        return self.wo(out.transpose(1, 2).reshape(b, s, c.dim))


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class OutputHead(nn.Linear):
    """The projection to the vocabulary: an nn.Linear with a class of its own, so that a wrap policy
    can make it a unit without making every Linear one."""


# One sharding unit per Block, and the embedding and the output head apart from the root: each is as
# large as several blocks (at 8B: 525M parameters against 218M), so the step starts by gathering the
# embedding alone and the head's gradient is reduced while the blocks' backward runs (torchtitan
# wraps Llama the same way).
SHARD_UNITS = frozenset({Block, Embedding, OutputHead})


def splits_embedding(*, table_params: int, block_params: int) -> bool:
    """Whether the default cut gives the embedding and the head units of their own (`SHARD_UNITS`):
    when the table is at least a block's size. Smaller tables ride in the root unit: their own units
    would add a lookup's three collectives and the head's two, which at that size cost more in
    latency than they save in bytes (2 CPU ranks, the 1.7M-parameter default: 4-10% slower)."""
    return table_params >= block_params


def default_units(cfg: LlamaConfig) -> frozenset[type[nn.Module]]:
    """The sharding units `shardtrain train`, `shardtrain plan` and the estimator give a built-in Llama."""
    split = splits_embedding(table_params=cfg.vocab_size * cfg.dim, block_params=cfg.block_params)
    return SHARD_UNITS if split else frozenset({Block})


class Llama(nn.Module):
    """Returns logits of shape (batch, seq, vocab); `loss(tokens, targets)` gives mean cross-entropy."""

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

    def reset_parameters(self) -> None:
        """Initialise this module's own state (the rotary tables); submodules initialise themselves."""
        cos, sin = rotary_tables(self.cfg, device=self.rope_cos.device)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token (ANCHORS.md formula): 6·(params − embedding) + 6·layers·dim·seq."""
    return 6 * cfg.num_params(include_embedding=False) + 6 * cfg.n_layers * cfg.dim * seq_len

