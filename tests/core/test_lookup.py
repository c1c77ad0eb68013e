"""Sharded embedding lookups (core/lookup.py): which units run them, and their values against torch's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardtrain as st
from shardtrain.core.lookup import LookupUnit
from shardtrain.core.shard_module import runtime_of
from shardtrain.models.llama import SHARD_UNITS
from tests.models import PaddedBag, split_llama, tiny_llama


def _lookup_units(model: nn.Module) -> list[str]:
    return [u.name for u in runtime_of(model).units if isinstance(u, LookupUnit)]


def which_units_look_up() -> dict[str, list[str]]:
    def max_norm_bag() -> nn.Module:
        bag = PaddedBag()
        bag.embed.max_norm = 1.0
        return bag

    built = {
        "split": lambda: st.shard(split_llama(), wrap=SHARD_UNITS),
        "zero2": lambda: st.shard(split_llama(), wrap=SHARD_UNITS, strategy="shard_grad_op"),
        "tied": lambda: st.shard(tiny_llama(), wrap=SHARD_UNITS),
        "no_shard": lambda: st.shard(split_llama(), wrap=SHARD_UNITS, strategy="no_shard"),
        "optimizer_only": lambda: st.shard(split_llama(), wrap=SHARD_UNITS, strategy="optimizer_only"),
        "checkpointed": lambda: st.shard(PaddedBag(), wrap={nn.Embedding}, activation_checkpointing={nn.Embedding}),
        "max_norm": lambda: st.shard(max_norm_bag(), wrap={nn.Embedding}),
        "offloaded": lambda: st.shard(split_llama(), wrap=SHARD_UNITS, cpu_offload=True),
    }
    return {name: _lookup_units(build()) for name, build in built.items()}


def test_which_units_look_up(pools):
    seen = pools(2).run(which_units_look_up)[0]
    # Note: on the CPU cpu_offload changes nothing (the shard already lives in host memory).
    assert seen == {
        "split": ["embed"],
        "zero2": ["embed"],
        "tied": [],
        "no_shard": [],
        "optimizer_only": [],
        "checkpointed": [],
        "max_norm": [],
        "offloaded": ["embed"],
    }


def uneven_batches_match_torch() -> dict[str, float]:
    """Ranks feed different token counts (and the padding index); values against torch on the full table."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = nn.Embedding(37, 6, padding_idx=3)
    model = nn.Sequential(nn.Embedding(37, 6, padding_idx=3))
    model[0].load_state_dict(full.state_dict())
    st.shard(model, wrap={nn.Embedding})
    g = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, 37, (1 + r, 5), generator=g) for r in range(world)]
    weights = [torch.randn(1 + r, 5, 6, generator=g) for r in range(world)]
    out = model(tokens[rank])
    (out * weights[rank]).sum().backward()
    expected_grad = torch.zeros_like(full.weight)
    for t, w in zip(tokens, weights):
        full.zero_grad()
        (full(t) * w).sum().backward()
        expected_grad += full.weight.grad
    expected_grad /= world
    with torch.no_grad():
        evaluated = model(tokens[rank])
    got = st.full_state_dict(model, rank0_only=False)
    unit = runtime_of(model).units[-1]
    grad = dict(model.named_parameters())["0.weight"].grad
    want = expected_grad[unit.layout.params[0].held_rows(dist.get_rank())[0] :][: grad.to_local().shape[0]]
    grad = grad.to_local()
    return {
        "out": (out - full(tokens[rank])).abs().max().item(),
        "eval": (evaluated - out).abs().max().item(),
        "grad": (grad - want).abs().max().item(),
        "padding_row_grad": expected_grad[3].abs().max().item(),
        "weights": (got["0.weight"] - full.weight).abs().max().item(),
        "gathered_table": sum(b._unsharded.untyped_storage().size() for b in unit.buffers),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_batches_and_padding_index_match_torch(pools, world):
    for seen in pools(world).run(uneven_batches_match_torch):
        assert seen == {
            "out": 0.0,
            "eval": 0.0,
            "grad": pytest.approx(0.0, abs=1e-6),
            "padding_row_grad": 0.0,
            "weights": 0.0,
            "gathered_table": 0,
        }


def frozen_table_and_int32_ids() -> dict[str, object]:
    torch.manual_seed(0)
    model = split_llama()
    model.embed.weight.requires_grad_(False)
    st.shard(model, wrap=SHARD_UNITS)
    x = torch.randint(0, 256, (2, 8), dtype=torch.int32)
    logits = model(x)
    logits.float().sum().backward()
    embed_grads = [p.grad for n, p in model.named_parameters() if n.startswith("embed")]
    try:
        model.embed(torch.zeros(2, 3))
        bad = None
    except TypeError as err:
        bad = str(err)
    return {
        "units": _lookup_units(model),
        "embed_grads": embed_grads,
        "head_grad": model.head.weight.grad is not None,
        "bad": bad,
    }


def test_frozen_table_int32_ids_and_float_ids(pools):
    seen = pools(2).run(frozen_table_and_int32_ids)[0]
    assert seen["units"] == ["embed"] and seen["embed_grads"] == [None] and seen["head_grad"]
    assert "embedding indices must be int32 or int64, got torch.float32" in seen["bad"]


def prefetch_order_skips_lookups() -> dict[str, list[str]]:
    torch.manual_seed(0)
    model = st.shard(split_llama(), wrap=SHARD_UNITS)
    model(torch.randint(0, 256, (2, 8))).float().sum().backward()
    runtime = runtime_of(model)
    names = {u.index: u.name for u in runtime.units}
    return {
        "after_root": [u.name for u in runtime._next_forward[0]],
        "forward_prefetchers": sorted(names[i] for i, nxt in runtime._next_forward.items() if nxt),
    }


def test_prefetch_order_skips_the_lookup(pools):
    # The root's pre-forward prefetches the first block: the embedding between them never gathers.
    seen = pools(2).run(prefetch_order_skips_lookups)[0]
    assert seen["after_root"] == ["layers.0"]
    assert "embed" not in seen["forward_prefetchers"]
