"""The built-in Llama's description: its configuration, the named sizes, and the arithmetic on them.

Plain dataclasses and numbers, no modules: the planner and the memory estimator read a model from here
(`models/llama.py` builds the modules).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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
    "125m": LlamaConfig(
        vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, max_seq_len=2048
    ),
    "1.5b": LlamaConfig(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=16,
        n_kv_heads=8,
        ffn_dim=8192,
        max_seq_len=4096,
        rope_theta=500000.0,
    ),
    "8b": LlamaConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=4096,
        rope_theta=500000.0,
    ),
    "12b": LlamaConfig(
        vocab_size=128256,
        dim=5120,
        n_layers=40,
        n_heads=40,
        n_kv_heads=8,
        ffn_dim=13824,
        max_seq_len=4096,
        rope_theta=500000.0,
    ),
    "14b": LlamaConfig(
        vocab_size=128256,
        dim=5120,
        n_layers=48,
        n_heads=40,
        n_kv_heads=8,
        ffn_dim=13824,
        max_seq_len=4096,
        rope_theta=500000.0,
    ),
    "18b": LlamaConfig(
        vocab_size=128256,
        dim=6144,
        n_layers=44,
        n_heads=48,
        n_kv_heads=8,
        ffn_dim=16384,
        max_seq_len=4096,
        rope_theta=500000.0,
    ),
    "30b": LlamaConfig(
        vocab_size=128256,
        dim=6656,
        n_layers=60,
        n_heads=52,
        n_kv_heads=4,
        ffn_dim=17920,
        max_seq_len=4096,
        rope_theta=500000.0,
    ),
}


def llama_config(name: str, **overrides) -> LlamaConfig:
    key = name.lower()
    if key not in LLAMA_SIZES:
        raise ValueError(f"unknown Llama size {name!r}; built-in sizes are {list(LLAMA_SIZES)}")
    return replace(LLAMA_SIZES[key], **overrides)


def splits_embedding(*, table_params: int, block_params: int) -> bool:
    """Whether the default cut gives the embedding and the head units of their own (`SHARD_UNITS`):
    when the table is at least a block's size. Smaller tables ride in the root unit: their own units
    would add a lookup's three collectives and the head's two, which at that size cost more in
    latency than they save in bytes (BENCHMARKS.md, 'Tried and rejected')."""
    return table_params >= block_params


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6·(params − embedding) + 6·layers·dim·seq (matmuls forward and backward, plus
    attention)."""
    return 6 * cfg.num_params(include_embedding=False) + 6 * cfg.n_layers * cfg.dim * seq_len
