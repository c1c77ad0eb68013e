"""fp16 with dynamic loss scaling on sharded gradients matches torch.amp.GradScaler in one process,
and an overflow seen by one rank only skips the step on every rank."""

import copy

import torch
import torch.distributed as dist

import shardtrain as st
from shardtrain.core.sharded_param import local_of
from shardtrain.models.llama import Block
from tests.core.parity import FP32_TOL, make_optimizer
from tests.models import lm_loss, make_batches, tiny_llama

OVERFLOW_STEP = 3


def _scaled_training(strategy: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = tiny_llama()
    model = st.shard(copy.deepcopy(ref), strategy=strategy, wrap={Block}, mixed_precision="fp16")
    opt, ref_opt = make_optimizer(model, "adamw"), make_optimizer(ref, "adamw")
    kwargs = dict(init_scale=2.0**12, growth_interval=3)
    scaler, ref_scaler = st.GradScaler(**kwargs), torch.amp.GradScaler("cpu", **kwargs)
    skipped = []
    for step, (x, y) in enumerate(make_batches("llama", steps=8, global_batch=2 * world)):
        chunks = [(x[2 * r : 2 * r + 2], y[2 * r : 2 * r + 2]) for r in range(world)]
        scaler.scale(lm_loss(model, chunks[rank])).backward()
        if step == OVERFLOW_STEP and rank == world - 1:
            grad = next(local_of(p.grad) for p in model.parameters() if p.grad is not None and local_of(p.grad).numel())
            grad.view(-1)[0] = float("inf")  # an overflow in the last rank's rows only
        before = [local_of(p).detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(all(torch.equal(a, local_of(p)) for a, p in zip(before, model.parameters())))

        low = copy.deepcopy(ref).half()
        total = None
        for cx, cy in chunks:
            low.zero_grad()
            ref_scaler.scale(lm_loss(low, (cx, cy))).backward()
            grads = [p.grad.float() for p in low.parameters()]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for p, g in zip(ref.parameters(), total):
            p.grad = g / world
        if step == OVERFLOW_STEP:
            next(ref.parameters()).grad.view(-1)[0] = float("inf")
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
    full = st.full_state_dict(model, rank0_only=False)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(full[name], value, **FP32_TOL, msg=lambda m: f"{strategy} {name}: {m}")
    return {"skipped": skipped, "scale": scaler.get_scale(), "ref_scale": ref_scaler.get_scale()}


def test_fp16_loss_scaling_matches_torch_and_skips_on_every_rank(pools):
    for strategy in ["full_shard", "no_shard"]:
        out = pools(2).run(_scaled_training, strategy)
        for r in out:
            assert r["skipped"] == [i == OVERFLOW_STEP for i in range(8)], r
            # grown after steps 0-2, halved at the overflow, grown again after steps 4-6
            assert r["scale"] == r["ref_scale"] == 2.0**12 * 2 / 2 * 2, r
