"""The ideal step: what one GPU of an N-way sharded run would take with nothing but its own work.

Forward and backward of the same model with its parameters resident in the compute dtype (no
all-gather, no reduce-scatter, no casts), then a fused AdamW step over 1/N of the parameters in fp32
(the optimizer work one rank owns). No engine can beat it on this hardware, so a run's step time
over the ideal step time is the overhead that engine adds.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .engines import Prepared, checkpoint_blocks, compute_dtype, make_optimizer
from .same_weights import build_meta_model
from .spec import RunSpec


class ShardStep:
    """Stands in for one rank's optimizer: fused AdamW over fp32 shards of 1/N of each parameter
    (one tensor per parameter, as a sharded engine hands them to its optimizer).

    `zero_grad` clears the model's resident gradients, as the real optimizer's would.
    """

    def __init__(self, model: nn.Module, *, shard_world: int, device: torch.device) -> None:
        self.model = model
        self.shards = [
            nn.Parameter(torch.zeros(math.ceil(p.numel() / shard_world), device=device)) for p in model.parameters()
        ]
        for shard in self.shards:
            shard.grad = torch.zeros_like(shard)  # its values do not change the work done
        self.adamw = make_optimizer(self.shards)

    def step(self) -> None:
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)


def build_ideal(spec: RunSpec, device: torch.device) -> Prepared:
    named = build_meta_model(spec.model_config(), float8=spec.float8)
    model = named.model.to(dtype=compute_dtype(spec) or torch.float32)  # on meta: only the dtype changes
    model.to_empty(device=device)
    named.init_all_(seed=spec.seed, device=device)
    if spec.ac:
        checkpoint_blocks(model)
    return Prepared(model=model, optimizer=ShardStep(model, shard_world=spec.shard_world, device=device))
