"""Small models that exercise the engine's corner cases, shared by the test modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.models.llama import SHARD_UNITS, Block, Llama, llama_config
from tests import foreign_models


def tiny_llama() -> Llama:
    """(a) A Llama-style transformer with tied input/output embeddings."""
    return Llama(llama_config("tiny", tie_embeddings=True, n_layers=3))


def split_llama() -> Llama:
    """(a') The Llama untied, for SHARD_UNITS: the embedding is a unit of its own (a sharded lookup)."""
    return Llama(llama_config("tiny", n_layers=2))


class PaddedBag(nn.Module):
    """(d) An embedding with a padding index and a table whose rows straddle the shards of 3 and 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 6, padding_idx=3)
        self.out = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(x)).mean(dim=1))


class ConvNet(nn.Module):
    """(b) A CNN with BatchNorm (buffers) and a parameter count not divisible by 3 or 4."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 13, 3, padding=1, bias=False),
            nn.BatchNorm2d(13),
            nn.ReLU(),
            nn.AvgPool2d(3),  # deterministic backward on CUDA, unlike the adaptive pool
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(52, 33), nn.ReLU(), nn.Linear(33, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class FrozenShared(nn.Module):
    """(c) Frozen layers, a module called twice per forward, and a never-used parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(7, 12)
        self.frozen = Residual(12)
        self.shared = Residual(12)
        self.tail = Residual(12)
        self.out = nn.Linear(12, 3)
        self.unused = nn.Linear(12, 12)
        for p in self.frozen.parameters():
            p.requires_grad_(False)
        self.stem.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.stem(x))
        h = self.shared(self.tail(self.shared(h)))
        return self.out(h)


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return model.loss(x, y) if isinstance(model, Llama) else F.cross_entropy(model(x), y)


def make_batches(kind: str, *, steps: int, global_batch: int, seed: int = 1234):
    """Deterministic global batches; every rank draws the same ones and takes its slice."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if kind in foreign_models.FACTORIES:
            out.append(foreign_models.batch(kind, global_batch, g))
        elif kind.endswith("llama"):
            toks = torch.randint(0, 256, (global_batch, 17), generator=g)
            out.append((toks[:, :-1], toks[:, 1:]))
        elif kind == "bag":
            out.append(
                (
                    torch.randint(0, 37, (global_batch, 9), generator=g),
                    torch.randint(0, 5, (global_batch,), generator=g),
                )
            )
        elif kind == "cnn":
            out.append(
                (torch.randn(global_batch, 3, 6, 6, generator=g), torch.randint(0, 5, (global_batch,), generator=g))
            )
        else:
            out.append((torch.randn(global_batch, 7, generator=g), torch.randint(0, 3, (global_batch,), generator=g)))
    return out


MODELS = {
    "llama": (tiny_llama, {Block}),
    "cnn": (ConvNet, None),  # wrap given per test: a SizePolicy
    "frozen": (FrozenShared, {Residual}),
    "split_llama": (split_llama, SHARD_UNITS),
    "bag": (PaddedBag, {nn.Embedding}),
}
