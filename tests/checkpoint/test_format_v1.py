"""Checkpoints written in format version 1 (one flat tensor per unit) load into today's sharded model,
at any world size, with their optimizer state, and train on."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import shardtrain as st
from shardtrain.models.llama import Block, Llama, llama_config
from tests.checkpoint.train_save_ranks import gathered_optimizer_state

DATA = Path(__file__).parent / "data"


def _model() -> Llama:
    config = llama_config(
        "tiny", vocab_size=40, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=24, max_seq_len=16
    )
    return Llama(config)


def load_format_v1(strategy: str) -> dict:
    torch.manual_seed(1)  # other weights than the saved ones
    model = st.shard(_model(), strategy=strategy, wrap={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rest = st.load_checkpoint(DATA / "format_v1", {"model": model, "optimizer": opt})
    expected = load_file(DATA / "format_v1_expected.safetensors")
    full = st.full_state_dict(model, rank0_only=False)
    weights = max((full[k] - v).abs().max().item() for k, v in expected.items() if not k.startswith("state."))
    state = gathered_optimizer_state(model, opt)
    moments = max(
        (state[name][key] - v).abs().max().item()
        for k, v in expected.items()
        if k.startswith("state.")
        for name, key in [k[len("state.") :].rsplit(".", 1)]
    )
    tokens = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    return {
        "rest": rest,
        "weights": weights,
        "moments": moments,
        "steps": {float(s["step"]) for s in opt.state.values()},
    }


@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_format_1_checkpoint_loads_at_any_world_size(pools, world):
    for strategy in ["full_shard", "no_shard"] if world == 2 else ["full_shard"]:
        for r in pools(world).run(load_format_v1, strategy):
            assert r["rest"] == {"step": 2}
            assert r["weights"] == 0.0 and r["moments"] == 0.0, (world, strategy, r)
            assert r["steps"] == {3.0}, r  # the saved step count went on
