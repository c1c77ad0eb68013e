"""Rank-side code of the optimizer tests (run on every rank of a `pools(n)` process group).

Each `--optim.name` optimizer steps the sharded Llama (its parameters DTensors of rows) and an
unsharded reference in this process, which replays every rank's rows of each global batch and
averages their gradients: the losses and final weights agree to fp32 tolerance. Then the sharded run
is saved half way, loaded into a fresh model and optimizer, and continued: it equals the straight run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardtrain as st
from shardtrain.models.llama import Block, Embedding, OutputHead
from shardtrain.train.optimizers import build_optimizer, muon_groups, weight_decay_groups
from shardtrain.train.sections import OptimConfig
from tests.core.parity import FP32_TOL
from tests.models import lm_loss, make_batches, split_llama

PER = 2  # sequences per rank per step
STEPS = 6


def _optimizer(model, name: str) -> torch.optim.Optimizer:
    cfg = OptimConfig(name=name, lr=1e-2, weight_decay=0.1)
    return build_optimizer(cfg, model, device=torch.device("cpu"))


def _sharded(name: str, seed: int):
    torch.manual_seed(seed)
    model = st.shard(split_llama(), wrap={Block, Embedding, OutputHead})
    return model, _optimizer(model, name)


def _step(model, optimizer, batch, rank: int) -> torch.Tensor:
    x, y = (t[rank * PER : (rank + 1) * PER] for t in batch)
    loss = lm_loss(model, (x, y))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _torch_optimizers(model, name: str) -> list[torch.optim.Optimizer]:
    """The reference's optimizers: torch's own classes on the unsharded model (Muon's recipe as two)."""
    groups = weight_decay_groups([p for p in model.parameters()], 0.1)
    if name == "adafactor":
        return [torch.optim.Adafactor(groups, lr=1e-2)]
    if name == "muon":
        hidden, *rest = muon_groups(model, list(model.parameters()), 0.1)
        return [
            torch.optim.Muon([hidden], lr=1e-2, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=1e-2, betas=(0.9, 0.95)),
        ]
    return [_optimizer(model, name)]  # adamw, sgd: elementwise, stepped on the rows as they are


def _reference(name: str, batches, world: int) -> tuple[list[list[torch.Tensor]], dict]:
    torch.manual_seed(0)
    model = split_llama()
    optimizers = _torch_optimizers(model, name)
    losses = []
    for batch in batches:
        per_rank = []
        for r in range(world):
            x, y = (t[r * PER : (r + 1) * PER] for t in batch)
            loss = lm_loss(model, (x, y)) / world
            loss.backward()
            per_rank.append(loss.detach() * world)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(per_rank)
    return losses, model.state_dict()


def optimizer_matches_reference_and_resumes(name: str, directory: str) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches("llama", steps=STEPS, global_batch=world * PER)
    expected_losses, expected_state = _reference(name, batches, world)

    model, optimizer = _sharded(name, seed=0)
    straight = [_step(model, optimizer, batch, rank) for batch in batches]
    for step, (loss, expected) in enumerate(zip(straight, expected_losses)):
        torch.testing.assert_close(loss, expected[rank], **FP32_TOL, msg=lambda m: f"{name} step {step}: {m}")
    full = st.full_state_dict(model, rank0_only=False)
    for key, value in expected_state.items():
        torch.testing.assert_close(full[key], value, **FP32_TOL, msg=lambda m: f"{name} {key}: {m}")

    half = STEPS // 2
    model, optimizer = _sharded(name, seed=0)
    first = [_step(model, optimizer, batch, rank) for batch in batches[:half]]
    st.save_checkpoint(f"{directory}/{name}", {"model": model, "optimizer": optimizer})
    del model, optimizer
    model, optimizer = _sharded(name, seed=1)  # other weights: the load must overwrite them
    st.load_checkpoint(f"{directory}/{name}", {"model": model, "optimizer": optimizer})
    rest = [_step(model, optimizer, batch, rank) for batch in batches[half:]]
    for step, (a, b) in enumerate(zip(straight, first + rest)):
        assert torch.equal(a, b), f"{name} step {step}: loss {b.item()!r} after resume vs {a.item()!r} straight"
    resumed = st.full_state_dict(model, rank0_only=False)
    for key, value in full.items():
        assert torch.equal(resumed[key], value), f"{name} {key} differs after resume"
    return [loss.item() for loss in straight]
