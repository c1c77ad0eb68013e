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
from shardtrain.core.shard_module import runtime_of
from shardtrain.core.sharded_param import local_of
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
            chunk = tuple(t[start : start + PER] for t in batch)
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
    """Full optimizer state by parameter name, assembled from the pieces of the first replica's ranks
    (what a checkpoint holds; hybrid_shard and no_shard replicas should hold the same), on every rank."""
    runtime = runtime_of(model)
    replicate = runtime.comm.replicate
    first_replica = replicate is None or dist.get_rank(replicate) == 0
    mine = {}
    for unit in runtime.units if first_replica else []:
        for shard, param in zip(unit.layout.params, unit.params):
            if param not in optimizer.state:
                continue
            start = shard.held_rows(runtime.comm.shard_rank if shard.world > 1 else 0)[0] * shard.row_numel
            mine[shard.fqn] = (
                shard.shape,
                start,
                {k: local_of(v).detach().clone() for k, v in optimizer.state[param].items()},
            )
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
                full[start : start + value.numel()] = value.reshape(-1)
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


# ------------------------------------------------------------------------------------ full weights
def save_full_and_forward(directory: str, fmt: str) -> tuple[dict, torch.Tensor]:
    """Train 2 steps, save in `fmt`; return the full state dict and the logits of a fixed input."""
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, batches(2, micro=1), micro=1)
    st.save_checkpoint(directory, state(model, optimizer, scheduler), format=fmt)
    tokens = torch.arange(32).remainder(256).view(2, 16)
    with torch.no_grad():
        logits = model(tokens)
    return st.full_state_dict(model, rank0_only=False), logits


# ------------------------------------------------------------------------------------ bad input
def expect_error(fn, match: str) -> str:
    """Run `fn`, which must raise ValueError matching `match` (a regex); return the message."""
    import pytest

    with pytest.raises(ValueError, match=match) as info:
        fn()
    return str(info.value)


def load_into(directory: str, model, **kwargs):
    return lambda: st.load_checkpoint(directory, {"model": model}, **kwargs)


def bad_inputs(directory: str) -> list[str]:
    """Each bad input fails with a ValueError that names the offending value and the remedy."""
    import json
    import shutil
    from pathlib import Path

    from shardtrain.models.llama import Llama, llama_config
    from tests.models import MODELS, FrozenShared

    rank = dist.get_rank()
    good = f"{directory}/good"
    model, optimizer, scheduler = build()
    st.save_checkpoint(good, state(model, optimizer, scheduler))
    messages = []
    other = st.shard(FrozenShared(), wrap=MODELS["frozen"][1])
    messages.append(
        expect_error(
            load_into(good, other),
            r"does not match state\['model'\] \(FrozenShared\): "
            r"missing \[frozen.lin.bias.*unexpected \[embed.weight.*strict=False",
        )
    )
    narrower = st.shard(Llama(llama_config("tiny", tie_embeddings=True, n_layers=3, ffn_dim=128)), wrap={Block})
    messages.append(
        expect_error(
            load_into(good, narrower),
            r"mis-shaped \[layers.0.ffn.w1.weight: checkpoint "
            r"\(176, 64\) vs model \(128, 64\)",
        )
    )
    st.load_checkpoint(good, {"model": narrower}, strict=False)  # the matching part loads
    assert torch.equal(
        st.full_state_dict(narrower, rank0_only=False)["embed.weight"],
        st.full_state_dict(model, rank0_only=False)["embed.weight"],
    )
    plain = tiny_llama()
    messages.append(
        expect_error(
            lambda: st.load_checkpoint(good, {"model": plain}),
            r"saved 'model' as a sharded module; pass the model after st.shard",
        )
    )
    with_ema = {**state(model, optimizer, scheduler), "ema": scheduler}
    messages.append(
        expect_error(
            lambda: st.load_checkpoint(good, with_ema), r"has no \[ema\]; it holds \[model, optimizer, scheduler\]"
        )
    )
    messages.append(expect_error(lambda: st.load_checkpoint(f"{directory}/nowhere", {}), "does not exist"))
    Path(directory, "empty").mkdir(exist_ok=True)
    messages.append(expect_error(lambda: st.load_checkpoint(f"{directory}/empty", {}), "is not a checkpoint"))

    def damaged(name: str, damage) -> str:
        copy = f"{directory}/{name}"
        if rank == 0:
            shutil.copytree(good, copy)
            damage(Path(copy))
        dist.barrier()
        return copy

    def truncate(path: Path) -> None:
        file = path / "model-00001-of-00002.safetensors"
        file.write_bytes(file.read_bytes()[:-100])

    def flip(path: Path) -> None:
        file = path / "model-00001-of-00002.safetensors"
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(bytes(data))

    def newer(path: Path) -> None:
        metadata = json.loads((path / "metadata.json").read_text())
        (path / "metadata.json").write_text(json.dumps({**metadata, "version": 99}))

    # Only rank 1 reads shard 1: rank 0 must fail too, naming rank 1.
    where = "" if rank == 1 else "rank 1 failed: ValueError: "
    messages.append(
        expect_error(
            load_into(damaged("truncated", truncate), model),
            f"{where}.*model-00001-of-00002.safetensors is truncated or altered",
        )
    )
    messages.append(
        expect_error(
            load_into(damaged("flipped", flip), model), f"{where}.*model-00001-of-00002.safetensors is corrupt: sha256"
        )
    )
    messages.append(
        expect_error(
            load_into(damaged("newer", newer), model),
            "format version 99, newer than the version 2 this shardtrain reads; upgrade",
        )
    )

    run = f"{directory}/run"
    st.save_checkpoint(f"{run}/a", {"model": model})
    messages.append(
        expect_error(
            lambda: st.save_checkpoint(f"{run}/b", {"model": model, "fn": print}),
            r"state\['fn'\] is a builtin_function_or_method",
        )
    )
    messages.append(
        expect_error(
            lambda: st.save_checkpoint(f"{run}/b", {"model": model, "t": torch.ones(3)}),
            r"state\['t'\] is a tensor of shape \(3,\)",
        )
    )

    class Opaque:
        def state_dict(self):
            return {"fn": Opaque}

        def load_state_dict(self, state):
            raise AssertionError("not reached")

    messages.append(
        expect_error(
            lambda: st.save_checkpoint(f"{run}/b", {"model": model, "o": Opaque()}),
            r"state\['o'\].state_dict\(\)\['fn'\] is a builtins.type; .*weights_only=True",
        )
    )
    messages.append(expect_error(lambda: st.save_checkpoint(f"{run}/b", {}, format="zip"), "format='zip'"))
    messages.append(expect_error(lambda: st.save_checkpoint(f"{run}/b", {}, keep_last=0), "keep_last=0"))
    assert sorted(p.name for p in Path(run).iterdir() if ".tmp-" not in p.name) == ["a", "latest"]
    return messages


# ------------------------------------------------------------------------------------ commit, values, rng
def rotate_and_overwrite(directory: str) -> None:
    """`latest` follows each save, keep_last prunes the oldest, an existing path is replaced, a stale
    staging directory is removed and unrelated directories are left alone."""
    from pathlib import Path

    run = Path(directory) / "run"
    model, optimizer, scheduler = build()
    if dist.get_rank() == 0:
        (run / "step9.tmp-0123456789abcdef0123456789abcdef").mkdir(parents=True)  # a crashed save's
        (run / "notes").mkdir()
    dist.barrier()
    for step in range(1, 5):
        st.save_checkpoint(run / f"step{step}", state(model, optimizer, scheduler, step=step), keep_last=2)
        assert (run / "latest").read_text().strip() == f"step{step}"
    assert sorted(p.name for p in run.iterdir()) == ["latest", "notes", "step3", "step4"]
    train(model, optimizer, scheduler, batches(1, micro=1), micro=1)
    st.save_checkpoint(run / "step3", state(model, optimizer, scheduler, step=5))  # overwrite an older one
    assert (run / "latest").read_text().strip() == "step3"
    assert sorted(p.name for p in run.iterdir()) == ["latest", "notes", "step3", "step4"]
    assert st.load_checkpoint(run, state(*build(seed=1)))["step"] == 5


class RankLocal:
    """An object whose state differs per rank (like an EMA of this rank's shards)."""

    def __init__(self, value: float) -> None:
        self.value = torch.tensor([value])

    def state_dict(self):
        return {"value": self.value, "rank": dist.get_rank()}

    def load_state_dict(self, state) -> None:
        self.value.copy_(state["value"])


def values_objects_and_rng(directory: str) -> None:
    """Plain values come back with their types; per-rank objects and generator states are restored."""
    import random

    import numpy as np

    model, optimizer, scheduler = build()
    values = {
        "step": 7,
        "pair": (1, 2.5),
        "nested": {"tokens": [1, 2], 3: None, "$odd": "x"},
        "scale": torch.tensor(0.5, dtype=torch.bfloat16),
        "name": "run-1",
    }
    rank = dist.get_rank()
    st.save_checkpoint(directory, {"model": model, "local": RankLocal(float(rank)), **values})
    after_save = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    local = RankLocal(-1.0)
    rest = st.load_checkpoint(directory, {"model": model, "local": local})
    assert rest.keys() == values.keys() and rest["scale"].dtype == torch.bfloat16
    assert all(rest[k] == v for k, v in values.items() if k != "scale") and torch.equal(rest["scale"], values["scale"])
    assert local.value.item() == float(rank)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert after_save[:2] == again[:2] and torch.equal(after_save[2], again[2])


# ------------------------------------------------------------------------------------ Hugging Face
def save_hf_model(directory: str) -> dict:
    """A tiny transformers Llama (tied embeddings), sharded and saved; returns its full state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = st.shard(LlamaForCausalLM(config), wrap={LlamaDecoderLayer})
    st.save_checkpoint(directory, {"model": model})
    return st.full_state_dict(model, rank0_only=False)
