"""Rank-side code of the checkpoint shape matrix: every parameter shape the engine shards, saved and
loaded bit for bit (tests/checkpoint/test_shapes.py).

`Odd` holds, beside two wrapped blocks: a one-element parameter and a parameter of fewer rows than
ranks (an `nn.Linear(8, 1)` value head), a 0-dim learnable scale, a parameter of 5 rows (uneven over 2
and 3 ranks), an embedding tied to an output projection in another unit, a frozen fp32 parameter, a
frozen bf16 parameter (a unit mixing dtypes) and an int64 buffer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

import shardtrain as st
from tests.checkpoint.train_save_ranks import assert_same, gathered_optimizer_state


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.uneven = nn.Parameter(torch.randn(5, 8) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + self.uneven.sum(0)


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 1)
        self.unembed = nn.Linear(8, 7, bias=False)
        self.unembed.weight = self.embed.weight  # tied
        self.logit_scale = nn.Parameter(torch.tensor(2.5))  # 0-dim
        self.frozen = nn.Parameter(torch.randn(3, 8), requires_grad=False)
        self.frozen_bf16 = nn.Parameter(torch.randn(5, 4).to(torch.bfloat16), requires_grad=False)
        self.register_buffer("seen", torch.arange(3, dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.frozen.sum(0) + self.frozen_bf16.float().sum()
        for block in self.blocks:
            h = block(h)
        return self.head(h).sum() * self.logit_scale + self.unembed(h).logsumexp(-1).mean()


TOKENS = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 1]])


def build(seed: int, strategy: str = "full_shard") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = st.shard(Odd(), strategy=strategy, wrap={Block})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, optimizer


def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(TOKENS).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def round_trip(directory: str, fmt: str, with_optimizer: bool, strategy: str = "full_shard") -> list[str]:
    """Train one step, save, load into a model of other weights: every parameter, buffer and
    optimizer state tensor equal bit for bit. Returns the names the full state dict holds."""
    torch.manual_seed(0)
    reference = Odd()
    model, optimizer = build(seed=0, strategy=strategy)
    full = st.full_state_dict(model, rank0_only=False)
    assert list(full) == list(reference.state_dict())  # the plain model's names, in its order
    assert_same(full, dict(reference.state_dict()), "full_state_dict")
    step(model, optimizer)
    with torch.no_grad():
        model.get_buffer("seen").add_(1)  # buffers are saved from rank 0: keep them equal
    saved = {"model": model, **({"optimizer": optimizer} if with_optimizer else {})}
    expected = st.full_state_dict(model, rank0_only=False)
    st.save_checkpoint(directory, saved, format=fmt)

    fresh, fresh_optimizer = build(seed=1, strategy=strategy)
    if with_optimizer:
        step(fresh, fresh_optimizer)  # other state: the load must replace it
    st.load_checkpoint(directory, {"model": fresh, **({"optimizer": fresh_optimizer} if with_optimizer else {})})
    assert_same(st.full_state_dict(fresh, rank0_only=False), expected, f"{fmt} parameters")
    if with_optimizer:
        assert_same(
            gathered_optimizer_state(fresh, fresh_optimizer),
            gathered_optimizer_state(model, optimizer),
            f"{fmt} optimizer state",
        )
        step(model, optimizer)
        step(fresh, fresh_optimizer)  # the loaded state steps exactly like the saved one
        assert_same(st.full_state_dict(fresh, rank0_only=False), st.full_state_dict(model, rank0_only=False), "step")
    again, _ = build(seed=1, strategy=strategy)
    st.load_full_state_dict(again, expected)
    assert_same(st.full_state_dict(again, rank0_only=False), expected, "load_full_state_dict")
    if fmt == "full":
        plain = Odd()
        plain.load_state_dict(load_file(Path(directory) / "model.safetensors"))  # strict
        assert_same(dict(plain.state_dict()), expected, "plain model")
    return sorted(expected)
