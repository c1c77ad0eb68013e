"""Rank-side code of the checkpoint tests (run on every rank of a `pools(n)` process group).

Training: tiny_llama (tied embeddings), AdamW with two param groups (tests.core.parity), a warm-up +
cosine LambdaLR, and per step `micro` micro-batches, all but the last under st.no_sync. Each rank
takes slice `(rank * micro + m) * per` of a global batch, as the parity reference does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import shardtrain as st
from shardtrain.core.shard import runtime_of
from shardtrain.models.llama import Block
from shardtrain.train.schedule import make_scheduler
from tests.core.parity import FP32_TOL, Case, Reference, make_optimizer
from tests.models import lm_loss, make_batches, tiny_llama

PER = 2  # sequences per micro-batch per rank


def build(strategy: str = "full_shard", *, seed: int = 0, mesh=None):
    """A fresh sharded model (initialised from `seed`), its AdamW and its LambdaLR."""
    torch.manual_seed(seed)
    model = st.shard(tiny_llama(), strategy=strategy, wrap={Block}, mesh=mesh)
    optimizer = make_optimizer(model, "adamw")
    scheduler = make_scheduler(optimizer, warmup_steps=3, total_steps=12, min_ratio=0.1)
    return model, optimizer, scheduler


def batches(steps: int, *, micro: int, seed: int = 1234):
    return make_batches("llama", steps=steps, global_batch=dist.get_world_size() * micro * PER, seed=seed)


def train(model, optimizer, scheduler, steps, *, micro: int) -> list[torch.Tensor]:
    """One optimizer step per global batch of `steps`; returns this rank's losses."""
    rank, losses = dist.get_rank(), []
    for batch in steps:
        total = torch.zeros(())
        for m in range(micro):
            start = (rank * micro + m) * PER
            chunk = tuple(t[start:start + PER] for t in batch)
            with st.no_sync(model) if m < micro - 1 else contextlib.nullcontext():
                loss = lm_loss(model, chunk) / micro
                loss.backward()
            total += loss.detach()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def state(model, optimizer, scheduler, **values) -> dict:
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, **values}


def gathered_optimizer_state(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Full optimizer state by parameter name, assembled from every rank's pieces (every rank gets it)."""
    mine = {}
    for unit in runtime_of(model).units:
        for slot, param in zip(unit.layout.slots, unit.shard_params):
            if param not in optimizer.state:
                continue
            start = 0 if unit.layout.shard_world == 1 else unit.layout.local_piece(slot, unit.groups.shard_rank).param_start
            mine[slot.fqn] = (slot.shape, start, {k: v.detach().clone() for k, v in optimizer.state[param].items()})
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for pieces in everyone:
        for fqn, (shape, start, values) in pieces.items():
            entry = out.setdefault(fqn, {})
            for key, value in values.items():
                if value.dim() == 0:
                    entry[key] = value
                    continue
                full = entry.setdefault(key, torch.zeros(shape, dtype=value.dtype)).view(-1)
                full[start:start + value.numel()] = value.reshape(-1)
    return out


def assert_same(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: keys {sorted(actual)} vs {sorted(expected)}"
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_same(actual[key], value, f"{what}[{key}]")
        else:
            assert torch.equal(actual[key], value), f"{what}[{key}] differs"


# ------------------------------------------------------------------------------------ resume
def resume_exactly(strategy: str, directory: str) -> list[float]:
    """12 steps straight == 6 steps, save, load into fresh objects, 6 steps: bit for bit."""
    micro = 2
    data = batches(12, micro=micro)
    straight_objects = build(strategy)
    straight = train(*straight_objects, data, micro=micro)
    expected = st.full_state_dict(straight_objects[0], rank0_only=False)

    model, optimizer, scheduler = build(strategy)
    first = train(model, optimizer, scheduler, data[:6], micro=micro)
    st.save_checkpoint(f"{directory}/step6", state(model, optimizer, scheduler, step=6, note="half way"))
    del model, optimizer, scheduler

    model, optimizer, scheduler = build(strategy, seed=1)  # other weights: the load must overwrite them
    rest = st.load_checkpoint(directory, state(model, optimizer, scheduler))  # through the `latest` pointer
    assert rest == {"step": 6, "note": "half way"}, rest
    second = train(model, optimizer, scheduler, data[6:], micro=micro)
    for step, (a, b) in enumerate(zip(straight, first + second)):
        assert torch.equal(a, b), f"{strategy} step {step}: loss {b.item()!r} after resume vs {a.item()!r} straight"
    assert_same(st.full_state_dict(model, rank0_only=False), expected, f"{strategy} final parameters")
    return [loss.item() for loss in second]


# ------------------------------------------------------------------------------------ resharding
def save_trained(directory: str, strategy: str, fmt: str, mesh=None) -> tuple[dict, dict]:
    """Train 3 steps, save; return the full parameters and the gathered optimizer state."""
    model, optimizer, scheduler = build(strategy, mesh=mesh)
    train(model, optimizer, scheduler, batches(3, micro=1), micro=1)
    st.save_checkpoint(directory, state(model, optimizer, scheduler, step=3), format=fmt)
    return st.full_state_dict(model, rank0_only=False), gathered_optimizer_state(model, optimizer)


def load_resharded(directory: str, params: dict, optim_state: dict) -> list[float]:
    """Load at this world size: parameters and optimizer state equal the saved ones, and training
    continues with the losses of an unsharded reference started from the same state."""
    model, optimizer, scheduler = build("full_shard", seed=1)
    assert st.load_checkpoint(directory, state(model, optimizer, scheduler)) == {"step": 3}
    assert_same(st.full_state_dict(model, rank0_only=False), params, "parameters")
    assert_same(gathered_optimizer_state(model, optimizer), optim_state, "optimizer state")
    assert scheduler.last_epoch == 3, scheduler.last_epoch

    reference_model = tiny_llama()
    reference_model.load_state_dict(params)
    reference = Reference(reference_model, Case(optim="adamw"), dist.get_world_size())
    names = {id(p): n for n, p in reference_model.named_parameters()}
    for ref_group, group in zip(reference.opt.param_groups, optimizer.param_groups):
        ref_group["lr"] = group["lr"]
        for p in ref_group["params"]:
            reference.opt.state[p] = {k: v.clone() for k, v in optim_state[names[id(p)]].items()}
    losses = []
    for step, batch in enumerate(batches(3, micro=1, seed=99)):
        (loss,) = train(model, optimizer, None, [batch], micro=1)
        expected = reference.step(batch, PER)[dist.get_rank()]
        torch.testing.assert_close(loss, expected.float(), **FP32_TOL, msg=lambda m: f"step {step}: {m}")
        losses.append(loss.item())
    return losses


# ------------------------------------------------------------------------------------ crash safety
def crash_during_save(rank: int, world: int, port: int, directory: str) -> None:
    """A 2-process job (not the pool): commit step2, then pause inside the save of step3 until killed."""
    import os
    import time
    from pathlib import Path

    from shardtrain.checkpoint import commit

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, optimizer, scheduler = build()
    data = batches(3, micro=1)
    train(model, optimizer, scheduler, data[:2], micro=1)
    st.save_checkpoint(f"{directory}/run/step2", state(model, optimizer, scheduler, step=2))
    expected = st.full_state_dict(model)
    if rank == 0:
        torch.save(expected, f"{directory}/expected.pt")
    train(model, optimizer, scheduler, data[2:], micro=1)

    def pause(staging: Path, rank: int) -> None:
        (Path(directory) / f"paused-{rank}").touch()
        time.sleep(600)

    commit.before_commit_hook = pause
    st.save_checkpoint(f"{directory}/run/step3", state(model, optimizer, scheduler, step=3))


def resume_after_crash(run: str, expected: dict) -> None:
    """The last committed checkpoint loads and trains on; the next save commits."""
    model, optimizer, scheduler = build(seed=1)
    assert st.load_checkpoint(run, state(model, optimizer, scheduler)) == {"step": 2}
    assert_same(st.full_state_dict(model, rank0_only=False), expected, "parameters after the crash")
    train(model, optimizer, scheduler, batches(3, micro=1)[2:], micro=1)
    st.save_checkpoint(f"{run}/step3", state(model, optimizer, scheduler, step=3))
    fresh, fresh_optimizer, fresh_scheduler = build(seed=2)
    assert st.load_checkpoint(run, state(fresh, fresh_optimizer, fresh_scheduler)) == {"step": 3}
    assert_same(st.full_state_dict(fresh, rank0_only=False), st.full_state_dict(model, rank0_only=False), "step3")
