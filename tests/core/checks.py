"""Rank-side checks of the engine's behaviour beyond parity (run inside the Gloo pools)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import shardtrain as st
from shardtrain.core.collectives import Collective, observe
from shardtrain.core.shard_module import runtime_of
from shardtrain.core.sharded_param import local_of
from shardtrain.models.llama import Block, RMSNorm, rotary_tables
from tests.models import FrozenShared, Residual, lm_loss, make_batches, tiny_llama


def state_bytes(strategy: str) -> int:
    """Bytes of parameters + gradients + optimizer state this rank holds after one AdamW step."""
    torch.manual_seed(0)
    model = st.shard(tiny_llama(), strategy=strategy, wrap={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batches("llama", steps=1, global_batch=2 * dist.get_world_size())[0]
    rank = dist.get_rank()
    lm_loss(model, tuple(t[2 * rank : 2 * rank + 2] for t in batch)).backward()
    opt.step()
    total = 0
    for unit in runtime_of(model).units:
        for buf in unit.buffers:
            total += buf.shard.numel() * buf.shard.element_size()
            total += buf.grad.numel() * buf.grad.element_size()
    for state in opt.state.values():
        total += sum(
            local_of(v).numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0
        )
    return total


def meta_init_is_unit_by_unit() -> dict:
    """Build on meta, materialise through st.shard; record the most parameters ever unsharded at once."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = tiny_llama()
    full_total = sum(p.numel() for p in model.parameters())
    peaks = []

    def init(module: nn.Module) -> None:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        live = sum(
            p.numel() for p in model.parameters() if not p.is_meta and p.dim() > 1 and not isinstance(p, DTensor)
        )  # sharded parameters (DTensors) hold only their rows
        peaks.append(live)

    st.shard(model, strategy="full_shard", wrap={Block}, param_init_fn=init)
    sd = st.full_state_dict(model, rank0_only=False)
    norms_ok = all(torch.equal(v, torch.ones_like(v)) for k, v in sd.items() if "norm" in k)
    cos, _ = rotary_tables(model.cfg)
    rope_ok = torch.allclose(model.rope_cos, cos)
    batch = make_batches("llama", steps=1, global_batch=2)[0]
    loss = lm_loss(model, batch)
    return {
        "max_live": max(peaks),
        "total": full_total,
        "norms_ok": norms_ok,
        "rope_ok": rope_ok,
        "loss": loss.item(),
        "checksum": sum(v.double().sum().item() for v in sd.values()),
    }


def synced_states() -> float:
    """Each rank builds different weights; sync_module_states makes every rank take rank 0's."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    model = tiny_llama()
    torch.manual_seed(100)
    expected = tiny_llama().state_dict()
    st.shard(model, strategy="full_shard", wrap={Block}, sync_module_states=True)
    sd = st.full_state_dict(model, rank0_only=False)
    return max((sd[k] - expected[k]).abs().max().item() for k in expected)


def full_state_dict_roundtrip() -> dict:
    """Full state dict: rank 0 only by default, original keys (tied names too), loads into the plain model."""
    torch.manual_seed(0)
    plain = tiny_llama()
    model = st.shard(copy.deepcopy(plain), strategy="full_shard", wrap={Block})
    sd = st.full_state_dict(model)
    if dist.get_rank() != 0:
        return {"empty": sd == {}}
    fresh = tiny_llama()
    fresh.load_state_dict(sd)
    x = make_batches("llama", steps=1, global_batch=2)[0][0]
    with torch.no_grad():
        same = torch.allclose(fresh(x), plain(x), atol=1e-6)
    return {
        "keys": list(sd) == list(plain.state_dict()),
        "outputs": same,
        "tied": sd["embed.weight"].data_ptr() == sd["head.weight"].data_ptr(),
    }


def unused_and_eval_behaviour() -> dict:
    """A never-used parameter keeps grad None; frozen ones too; an eval pass between steps is harmless."""
    torch.manual_seed(0)
    model = st.shard(FrozenShared(), strategy="full_shard", wrap={Residual})
    x, y = make_batches("frozen", steps=1, global_batch=4)[0]
    with torch.no_grad():
        before = model(x)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    names = {n: p.grad is None for n, p in model.named_parameters()}
    with torch.no_grad():
        after = model(x)
    return {
        "unused_none": names["unused.weight"] and names["unused.bias"],
        "frozen_none": names["frozen.lin.weight"] and names["stem.bias"],
        "used_has_grad": not names["shared.lin.weight"] and not names["out.weight"],
        "eval_stable": torch.equal(before, after),
    }


def collective_counts() -> dict:
    """Count all-gathers and reduce-scatters per training step (full_shard, 3 blocks + root)."""
    counts = {"gather": 0, "reduce": 0, "announce": 0}
    kinds = {"all_gather": "gather", "reduce_scatter": "reduce"}
    torch.manual_seed(0)
    model = st.shard(tiny_llama(), strategy="full_shard", wrap={Block})
    order_group = runtime_of(model).order.group  # the order check's own host-side exchanges

    def count(collective: Collective) -> None:
        if collective.group is order_group:
            counts["announce"] += 1
        elif collective.kind in kinds:
            counts[kinds[collective.kind]] += 1

    batch = make_batches("llama", steps=2, global_batch=4)
    rank = dist.get_rank()
    per_step = []
    with observe(count):
        for b in batch:
            counts.update(gather=0, reduce=0, announce=0)
            lm_loss(model, tuple(t[2 * rank : 2 * rank + 2] for t in b)).backward()
            per_step.append(dict(counts))
    return {"steps": per_step, "units": len(runtime_of(model).units)}


def rmsnorm_is_merged() -> bool:
    """Norms inside a block belong to the block's unit (no hooks on tiny modules)."""
    model = st.shard(tiny_llama(), strategy="full_shard", wrap={Block})
    return all(not m._forward_pre_hooks for m in model.modules() if isinstance(m, RMSNorm))


def auto_strategy(device_memory: str) -> dict:
    """st.shard_auto: the planner picks; the model then trains like any other."""
    torch.manual_seed(0)
    model, _ = st.shard_auto(
        tiny_llama(), policy=st.AutoPolicy(micro_batch=2, seq_len=16, device_memory=device_memory), wrap={Block}
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank = dist.get_rank()
    losses = []
    batch = make_batches("llama", steps=1, global_batch=4)[0]
    for _ in range(4):  # one batch, memorised: the loss must fall
        loss = lm_loss(model, tuple(t[2 * rank : 2 * rank + 2] for t in batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"strategy": runtime_of(model).strategy.value, "losses": losses}


def load_full_state_dict_roundtrip() -> dict:
    """Plain weights (e.g. a pretrained model) load into a sharded model; mismatches are named."""
    torch.manual_seed(1)
    plain = tiny_llama()
    torch.manual_seed(2)
    model = st.shard(tiny_llama(), strategy="full_shard", wrap={Block})
    st.load_full_state_dict(model, plain.state_dict())
    full = st.full_state_dict(model, rank0_only=False)
    equal = all(torch.equal(full[k], v) for k, v in plain.state_dict().items())
    bad = dict(plain.state_dict())
    bad["norm.weight"] = torch.ones(3)
    try:
        st.load_full_state_dict(model, bad)
        message = "no error"
    except ValueError as e:
        message = str(e)
    # a persistent buffer of the wrong shape is named too (copy_ would broadcast it silently)
    normed = st.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    try:
        st.load_full_state_dict(normed, {**normed.state_dict(), "1.running_mean": torch.ones(1)})
        buffer_message = "no error"
    except ValueError as e:
        buffer_message = str(e)
    return {
        "equal": equal,
        "mis_shaped_named": "norm.weight: checkpoint (3,) vs model (64,)" in message
        and "1.running_mean: checkpoint (1,) vs model (4,)" in buffer_message,
    }


def subgroups_keep_the_timeout() -> dict:
    """Groups st.shard creates (the order check's, the control group, hybrid's) time out as the group
    the model is sharded over does, not after torch's default 30 minutes; a second model sharded over
    the same group reuses them instead of making new ones."""
    from datetime import timedelta

    from shardtrain.core.process_groups import group_timeout

    parent = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=17))
    model = st.shard(tiny_llama(), strategy="full_shard", wrap={Block}, process_group=parent)
    runtime = runtime_of(model)
    hybrid = st.shard(
        tiny_llama(), strategy="hybrid_shard", wrap={Block}, process_group=parent, mesh=(1, dist.get_world_size())
    )
    groups = {
        "order": runtime.order.group,
        "control": runtime.control_group,
        "hybrid_shard": runtime_of(hybrid).comm.shard,
        "hybrid_replicate": runtime_of(hybrid).comm.replicate,
    }
    timeouts = {name: group_timeout(g).total_seconds() for name, g in groups.items()}
    again = st.shard(tiny_llama(), strategy="full_shard", wrap={Block}, process_group=parent)
    hybrid_again = st.shard(
        tiny_llama(), strategy="hybrid_shard", wrap={Block}, process_group=parent, mesh=(1, dist.get_world_size())
    )
    reused = runtime_of(again).order.group is groups["order"] and (
        runtime_of(hybrid_again).comm.shard is groups["hybrid_shard"]
        and runtime_of(hybrid_again).comm.replicate is groups["hybrid_replicate"]
    )
    return {**timeouts, "reused": reused}


def hf_cache_only_off_while_training() -> dict:
    """A checkpointed Hugging Face T5 trains with its key/value cache off and evaluates with it on."""
    from transformers.models.t5.modeling_t5 import T5Block

    from tests.foreign_models import hf_t5

    torch.manual_seed(0)
    model = hf_t5().model
    st.shard(model, wrap={T5Block}, activation_checkpointing={T5Block})
    x = torch.randint(0, 256, (2, 8))
    train = model(input_ids=x, decoder_input_ids=x)
    train.logits.sum().backward()
    model.eval()
    with torch.no_grad():
        evaluated = model(input_ids=x, decoder_input_ids=x)
    return {
        "train_cache": train.past_key_values is not None,
        "eval_cache": evaluated.past_key_values is not None,
        "config_kept": model.config.use_cache,
    }
