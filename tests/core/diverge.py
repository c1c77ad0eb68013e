"""Rank-side code of the order-check tests: models whose ranks take different paths."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardtrain as st
from shardtrain.core.order_check import RanksDiverged
from shardtrain.models.llama import Block, Llama, llama_config


class SkippingLlama(Llama):
    """A Llama whose forward skips the blocks named in `skip` (per rank)."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__(llama_config("tiny", n_layers=4))
        self.skip = skip

    def forward(self, tokens: torch.Tensor, *, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is not None:
            raise ValueError("SkippingLlama runs unpacked rows only; pass position_ids=None")
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = layer(x, self.rope_cos, self.rope_sin)
        return self.head(self.norm(x))


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TinyMoE(nn.Module):
    """Top-1 routing to experts that are units of their own; an expert with no token is not called."""

    def __init__(self, dim: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(dim=-1)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = choice == i
            if chosen.any():
                y[chosen] = expert(x[chosen])
        return self.out(y)


def device() -> torch.device:
    """Where a rank computes: its GPU under NCCL (tests/gpu/nccl_parity.py), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _train(model: nn.Module, step) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.monotonic()
    try:
        for _ in range(3):
            step(model).backward()
            opt.step()
            opt.zero_grad()
    except RanksDiverged as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def skipped_blocks(skips: list[list[int]]) -> dict:
    """Rank r skips the blocks `skips[r]`."""
    torch.manual_seed(0)
    model = st.shard(SkippingLlama(set(skips[dist.get_rank()])), wrap={Block})
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1)).to(device())
    return _train(model, lambda m: m.loss(tokens[:, :-1], tokens[:, 1:]))


def moe_with_an_idle_expert() -> dict:
    """Rank 1's tokens all route to expert 0, so experts 1-3 run on rank 0 only."""
    torch.manual_seed(0)
    model = st.shard(TinyMoE(), wrap={Expert})
    full = st.full_state_dict(model, rank0_only=False)
    pool = torch.randn(512, 8, generator=torch.Generator().manual_seed(2))
    choice = (pool @ full["router.weight"].T + full["router.bias"]).argmax(dim=-1)
    x = (pool[choice == 0][:16] if dist.get_rank() == 1 else pool[:16]).to(device())
    y = torch.randint(0, 3, (len(x),), generator=torch.Generator().manual_seed(3)).to(device())
    return _train(model, lambda m: F.cross_entropy(m(x), y))
