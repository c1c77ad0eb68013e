"""A small model for the Lightning tests: an embedding and a head held by the root unit (outside
the blocks), so that a forward path that skips the root's hooks would fail, and blocks as units."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM = 64, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())


def initial_state() -> dict[str, torch.Tensor]:
    """The same weights on every rank and in every run (DDP and shardtrain start from them)."""
    torch.manual_seed(0)
    return Toy().state_dict()


def batch(rank: int, index: int, size: int = 4, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `index` of `rank`: tokens and next-token targets."""
    g = torch.Generator().manual_seed(1000 * rank + index)
    tokens = torch.randint(0, VOCAB, (size, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def param_bytes(module: nn.Module) -> int:
    """Bytes of parameters this rank holds (a DTensor counts its local rows)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


class ReduceScatters:
    """Counts the gradient reduce-scatters shardtrain issues (`core.collectives.observe`)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, collective) -> None:
        if collective.kind == "reduce_scatter":
            self.count += 1

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def sharding_layout(sharded: nn.Module) -> dict[str, list[str]]:
    """The units of a model `st.shard` sharded (by module path) and the modules it recomputes in backward."""
    from shardtrain.core.shard_module import runtime_of

    return {
        "units": sorted(u.label for u in runtime_of(sharded).units),
        "checkpointed": sorted(p for p, m in sharded.named_modules() if m.__dict__.get("_shardtrain_checkpointed")),
    }
