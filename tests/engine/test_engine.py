"""The Engine's API: on a persistent Gloo pool (as under torchrun), and in its own spawn mode."""

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardtrain as st
from shardtrain.core.sharded_param import local_of
from shardtrain.engine import Engine
from shardtrain.models.llama import LLAMA_SIZES, Block, Llama


def _batch(step: int, micro: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    data = torch.randint(0, 256, (rows, 17), generator=g)
    return data[:, :-1], data[:, 1:]


def _train_like_the_reference(steps: int, accum: int) -> dict:
    """Engine (2 ranks, each half of every micro-batch) vs. one unsharded model on the whole batch."""
    engine = Engine(accelerator="cpu", wrap={Block})
    engine.launch()
    assert (engine.rank, engine.world_size) == (dist.get_rank(), 2) and engine.device.type == "cpu"
    cfg = LLAMA_SIZES["tiny"]
    torch.manual_seed(0)
    reference = Llama(cfg)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(0)
    with engine.init_module(empty_init=False):
        model = Llama(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, same_opt = engine.setup(model, opt)
    assert same_opt is opt
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    norms = []
    for step in range(steps):
        for micro in range(accum):
            inputs, targets = _batch(step, micro, rows=4)
            ref_loss = reference.loss(inputs, targets) / accum
            ref_loss.backward()
            half = slice(2 * engine.rank, 2 * engine.rank + 2)
            with engine.no_backward_sync(model, enabled=micro < accum - 1):
                engine.backward(model.loss(inputs[half], targets[half]) / accum)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        norms.append((engine.clip_gradients(model, opt, max_norm=0.5).item(), ref_norm.item()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = st.full_state_dict(model)
    if engine.rank == 0:
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=1.3e-6, atol=1e-5, msg=name)
    return {"norms": norms}


def test_setup_backward_accumulate_clip_match_unsharded_reference(pools):
    results = pools(2).run(_train_like_the_reference, 3, 2)
    assert results[0] == results[1], "the clipped norm must be the same on every rank"
    for engine_norm, ref_norm in results[0]["norms"]:
        assert engine_norm == pytest.approx(ref_norm, rel=1e-5)


def _collectives(tmp: str) -> dict:
    engine = Engine(accelerator="cpu")
    engine.launch()
    marker = Path(tmp) / "first"
    with engine.rank_zero_first():
        saw_marker = marker.exists()
        if engine.rank == 0:
            marker.write_text("rank 0 was here")
    engine.barrier()
    return {
        "saw_marker": saw_marker,
        "mean": engine.all_reduce(torch.tensor(float(engine.rank))).item(),
        "max": engine.all_reduce(torch.tensor(float(engine.rank)), op="max").item(),
        "gathered": engine.all_gather(torch.tensor([engine.rank])).flatten().tolist(),
        "broadcast": engine.broadcast({"from": engine.rank}),
        "seeded": (engine.seed_everything(3), torch.rand(2).tolist()),
    }


def test_collectives_and_rank_zero_first(pools, tmp_path):
    r0, r1 = pools(2).run(_collectives, str(tmp_path))
    assert (r0["saw_marker"], r1["saw_marker"]) == (False, True)
    assert r0["mean"] == r1["mean"] == 0.5 and r0["max"] == 1.0
    assert r0["gathered"] == r1["gathered"] == [0, 1]
    assert r0["broadcast"] == r1["broadcast"] == {"from": 0}
    assert r0["seeded"] == r1["seeded"], "seed_everything gives every rank the same stream"


def _meta_init_and_late_optimizer() -> list[float]:
    engine = Engine(accelerator="cpu", wrap={Block}, activation_checkpointing={Block})
    engine.launch()
    engine.seed_everything(0)
    with engine.init_module(empty_init=True):
        model = Llama(LLAMA_SIZES["tiny"])
    assert all(p.is_meta for p in model.parameters())
    model = engine.setup(model)
    assert not any(p.is_meta for p in model.parameters())
    return _memorise(engine, model, steps=5)  # the optimizer built after setup, from the shards


def _memorise(engine: Engine, model: torch.nn.Module, *, steps: int) -> list[float]:
    """The mean loss over the ranks of `steps` AdamW steps on one batch (it must fall)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets = _batch(0, 0, rows=2)
    losses = []
    for _ in range(steps):
        loss = model.loss(inputs, targets)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(engine.all_reduce(loss.detach()).item())
    return losses


def test_meta_init_activation_checkpointing_and_optimizer_after_setup(pools):
    losses = pools(2).run(_meta_init_and_late_optimizer)[0]
    assert losses[-1] < losses[0] - 0.5


def _planned_at_setup() -> dict:
    """Engine(strategy=st.AutoPolicy(...)): st.shard_auto plans the model at setup; it then trains."""
    engine = Engine(
        accelerator="cpu", wrap={Block}, strategy=st.AutoPolicy(micro_batch=2, seq_len=16, device_memory="8GiB")
    )
    engine.launch()
    engine.seed_everything(0)
    with engine.init_module(empty_init=True):
        model = Llama(LLAMA_SIZES["tiny"])
    model = engine.setup(model)
    return {"strategy": engine.strategy, "losses": _memorise(engine, model, steps=4)}


@pytest.mark.slow  # ~20 s of planning; the default tier covers st.shard_auto itself (tests/core/test_shard.py)
def test_auto_policy_is_planned_at_setup(pools):
    out = pools(2).run(_planned_at_setup)
    assert out[0]["strategy"] is out[1]["strategy"] and isinstance(out[0]["strategy"], st.Strategy)
    assert out[0]["losses"][-1] < out[0]["losses"][0]


def _foreign_optimizer() -> str:
    engine = Engine(accelerator="cpu")
    engine.launch()
    model = Llama(LLAMA_SIZES["tiny"])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    try:
        engine.setup(model, opt)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_optimizer_of_another_model_is_refused(pools):
    assert "not a parameter of the model" in pools(2).run(_foreign_optimizer)[0]


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"devices": 0}, "devices=0 is not understood"),
        ({"devices": "all"}, "devices='all' is not understood"),
        ({"accelerator": "tpu"}, "accelerator='tpu' is not known"),
        ({"strategy": "zero4"}, "unknown sharding strategy 'zero4'"),
        ({"precision": "int8"}, "mixed_precision='int8' is not understood"),
    ],
)
def test_bad_engine_arguments(kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        Engine(accelerator=kwargs.pop("accelerator", "cpu"), **kwargs)


def test_using_an_engine_before_launch_says_so():
    with pytest.raises(RuntimeError, match=r"call engine.launch\(\) before"):
        _ = Engine(accelerator="cpu").rank


def _save_and_load(path: str) -> bool:
    engine = Engine(accelerator="cpu", wrap={Block})
    engine.launch()
    engine.seed_everything(0)
    with engine.init_module():
        model = Llama(LLAMA_SIZES["tiny"])
    model, opt = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    inputs, targets = _batch(0, engine.rank, rows=2)
    engine.backward(model.loss(inputs, targets))
    opt.step()
    engine.save(path, {"model": model, "optimizer": opt, "step": 1})
    engine.seed_everything(1)
    with engine.init_module():
        fresh = Llama(LLAMA_SIZES["tiny"])
    fresh, fresh_opt = engine.setup(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    rest = engine.load(path, {"model": fresh, "optimizer": fresh_opt})
    same_weights = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    same_moments = all(
        torch.equal(opt.state[a]["exp_avg"], fresh_opt.state[b]["exp_avg"])
        for a, b in zip(model.parameters(), fresh.parameters())
        if a.numel()
    )
    return rest["step"] == 1 and same_weights and same_moments


def test_save_and_load_through_the_engine(pools, tmp_path):
    assert pools(2).run(_save_and_load, str(tmp_path / "ckpt")) == [True, True]


# ----------------------------------------------------------------------------------- spawn mode


def _spawned(engine: Engine, tag: str) -> dict:
    with engine.init_module(empty_init=True):
        model = Llama(LLAMA_SIZES["tiny"])
    model, opt = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inputs, targets = _batch(0, engine.rank, rows=2)
    engine.backward(model.loss(inputs, targets))
    norm = engine.clip_gradients(model, opt, max_norm=1.0)
    opt.step()
    return {
        "tag": tag,
        "rank": engine.rank,
        "world": engine.world_size,
        "env_rank": os.environ["RANK"],
        "pid": os.getpid(),
        "norms": engine.all_gather(norm.reshape(1)).flatten().tolist(),
    }


def test_spawn_mode_runs_fn_on_every_rank_and_returns_rank0_result():
    result = Engine(devices=2, accelerator="cpu").launch(_spawned, "hello")
    assert result["tag"] == "hello" and (result["rank"], result["world"], result["env_rank"]) == (0, 2, "0")
    assert result["pid"] != os.getpid()
    assert result["norms"][0] == result["norms"][1]


def _fails_on_rank_1(engine: Engine) -> None:
    if engine.rank == 1:
        raise RuntimeError("rank 1 gives up")
    engine.barrier()  # rank 0 would wait here forever if the failure were not propagated


def test_spawn_mode_failure_stops_all_ranks():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    start = time.monotonic()
    # The root cause reported is the first failure the launcher observes: rank 1's error, or rank 0's
    # barrier breaking because its peer died; either way every rank is stopped promptly.
    with pytest.raises(ChildFailedError, match="rank 1 gives up|Connection (closed|reset) by peer"):
        Engine(devices=2, accelerator="cpu").launch(_fails_on_rank_1)
    assert time.monotonic() - start < 60


def test_world_of_one_runs_in_process():
    try:
        result = Engine(devices=1, accelerator="cpu").launch(lambda e: (e.rank, e.world_size, os.getpid()))
    finally:
        dist.destroy_process_group()  # leave the test process as it was
    assert result == (0, 1, os.getpid())


def _fp16_training() -> dict:
    engine = Engine(accelerator="cpu", precision="16-mixed", wrap={Block})
    engine.launch()
    engine.seed_everything(0)
    with engine.init_module():
        model = Llama(LLAMA_SIZES["tiny"])
    model, opt = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    scale0 = engine.grad_scaler.get_scale()
    losses, skipped = [], []
    for step in range(6):
        inputs, targets = _batch(0, engine.rank, rows=2)
        loss = model.loss(inputs, targets)
        engine.backward(loss)
        if step == 2 and engine.rank == 1:
            grad = next(local_of(p.grad) for p in model.parameters() if p.grad is not None and local_of(p.grad).numel())
            grad.view(-1)[0] = float("inf")  # an overflow in rank 1's rows only
        engine.clip_gradients(model, opt, max_norm=1.0)
        before = [local_of(p).detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        skipped.append(all(torch.equal(a, local_of(b)) for a, b in zip(before, model.parameters())))
        losses.append(loss.item())
    halvings = engine.grad_scaler.get_scale() == scale0 * 0.5 ** sum(skipped)
    # The scaler's state (scale, growth tracker) goes through a checkpoint and comes back.
    import tempfile

    from shardtrain.ops.grad_scaler import GradScaler

    path = engine.broadcast(tempfile.mkdtemp() + "/ckpt")
    engine.save(path, {"model": model, "optimizer": opt, "grad_scaler": engine.grad_scaler})
    fresh = GradScaler("cpu", init_scale=1.0)
    engine.load(path, {"model": model, "optimizer": opt, "grad_scaler": fresh})
    restored = fresh.state_dict() == engine.grad_scaler.state_dict() and fresh.get_scale() != 1.0
    return {"skipped": skipped, "halved_per_skip": halvings, "learned": losses[-1] < losses[0], "restored": restored}


def test_fp16_engine_scales_losses_and_skips_overflow_on_every_rank(pools):
    out = pools(2).run(_fp16_training)
    assert out[0] == out[1], out  # every rank skips the same steps
    assert out[0]["skipped"][2] and not all(out[0]["skipped"]), out  # the injected overflow, seen by rank 1 only
    assert out[0]["halved_per_skip"] and out[0]["learned"] and out[0]["restored"], out


def test_fp16_step_goes_through_the_scaler_and_an_lr_scheduler_can_wrap_it():
    import warnings

    from shardtrain.engine.fp16_step import step_through_scaler
    from shardtrain.ops.grad_scaler import GradScaler
    from shardtrain.train.schedule import make_scheduler

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = GradScaler("cpu", init_scale=4.0)
    step_through_scaler(opt, scaler)
    scheduler = make_scheduler(opt, warmup_steps=2, total_steps=4, min_ratio=0.1)  # wraps opt.step.__func__
    moved, lrs = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for step in range(3):
            scaler.scale(model(torch.ones(1, 4)).sum()).backward()
            if step == 1:
                model.weight.grad[0, 0] = float("inf")
            before = model.weight.detach().clone()
            opt.step()
            scheduler.step()
            opt.zero_grad()
            moved.append(not torch.equal(before, model.weight))
            lrs.append(scheduler.get_last_lr()[0])
    assert moved == [True, False, True]  # the overflowing step is skipped
    assert scaler.get_scale() == 2.0 and scheduler.last_epoch == 3
    assert lrs == [pytest.approx(v) for v in (1.0, 1.0, 0.55)]
