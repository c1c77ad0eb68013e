"""Rank-side code of tests/ops/test_grad_norm.py: shardtrain's global gradient norm against a float64
norm of the same full gradients, and against torch's `clip_grad_norm_` over them unsharded in fp32.

The model's forward is the sum of `param * target` over its parameters, so each parameter's gradient
is exactly its target (the average of identical gradients over ranks is exact too): the test knows the
full gradients without gathering them. Many small 1-D tensors and a few large matrices, each of its
own magnitude, in units that shard (odd row counts leave padding rows) and a 0-dim scalar.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardtrain as st
from shardtrain.core.shard_module import runtime_of
from shardtrain.ops.grad_norm import grad_norm

BLOCKS = 3
SMALL_PER_BLOCK = 24
SMALL_SIZES = (1, 7, 64, 1000, 1500)  # few distinct shapes: sharding each new one costs time


class Leaves(nn.Module):
    """Parameters of the given shapes; forward returns the sum of each one times its target."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])

    def forward(self, targets: list[torch.Tensor]) -> torch.Tensor:
        return sum((w * t).sum() for w, t in zip(self.weights, targets))


class ManyTensors(nn.Module):
    """`BLOCKS` units (a large matrix and many vectors each) and a root holding the rest."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()

        def small() -> tuple[int, ...]:
            return (SMALL_SIZES[int(torch.randint(len(SMALL_SIZES), (), generator=generator))],)

        self.blocks = nn.ModuleList(
            [Leaves([(769, 1024)] + [small() for _ in range(SMALL_PER_BLOCK)]) for _ in range(BLOCKS)]
        )
        self.root = Leaves([(1001, 512), (), (3, 5)] + [small() for _ in range(SMALL_PER_BLOCK)])

    def forward(self, targets: list[list[torch.Tensor]]) -> torch.Tensor:
        parts = [*self.blocks, self.root]
        return sum(part(t) for part, t in zip(parts, targets))


def _targets(model: ManyTensors, generator: torch.Generator) -> list[list[torch.Tensor]]:
    """Per part, per parameter, a gradient of normal entries at a magnitude between 1e-3 and 1e2."""
    return [
        [
            torch.randn(w.shape, generator=generator) * 10 ** (torch.rand((), generator=generator) * 5 - 3)
            for w in p.weights
        ]
        for p in [*model.blocks, model.root]
    ]


def _full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if isinstance(grad, torch.distributed.tensor.DTensor) else grad


def norm_errors(strategy: str, seeds: list[int], **options: Any) -> list[dict]:
    """Per seed (of the gradients), the relative errors of shardtrain's and torch's global norms (2, 1
    and inf) against float64, and a clip: the gradients scaled by exactly the returned norm's coefficient.
    `options`: more of `st.shard`'s (the device, offload)."""
    model = ManyTensors(torch.Generator().manual_seed(0))
    model = st.shard(model, strategy=strategy, wrap={Leaves}, **({"device": "cpu"} | options))
    return [_errors(model, torch.Generator().manual_seed(seed)) for seed in seeds]


def _errors(model: ManyTensors, generator: torch.Generator) -> dict:
    model.zero_grad(set_to_none=True)
    device = runtime_of(model).comm.device
    targets = [[t.to(device) for t in part] for part in _targets(model, generator)]
    flat_targets = [t for part in targets for t in part]
    model(targets).backward()
    out: dict = {}
    full64 = torch.cat([t.double().reshape(-1) for t in flat_targets]).cpu()
    for norm_type in (2.0, 1.0, math.inf):
        exact = torch.linalg.vector_norm(full64, norm_type)
        reference = [nn.Parameter(t.clone()) for t in flat_targets]
        for p, t in zip(reference, flat_targets):
            p.grad = t.clone()
        theirs = torch.nn.utils.clip_grad_norm_(reference, max_norm=math.inf, norm_type=norm_type)
        ours = grad_norm(model, norm_type=norm_type)
        assert ours.dtype == torch.float32, ours.dtype
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, float(ours))
        assert len(set(everyone)) == 1, f"ranks disagree on the norm: {everyone}"
        out[norm_type] = {
            "ours": abs(float(ours.double() / exact - 1)),
            "torch": abs(float(theirs.double() / exact - 1)),
        }
    max_norm = float(torch.linalg.vector_norm(full64)) / 3
    total = st.clip_grad_norm_(model, max_norm)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    params = [p for part in [*model.blocks, model.root] for p in part.weights]
    out["clip_scaled_exactly"] = all(
        torch.equal(_full(p.grad).to(device), t * coef.to(device)) for p, t in zip(params, flat_targets)
    )
    out["clipped_norm"] = float(grad_norm(model)) / max_norm
    return out
