"""`--optim.name`: each optimizer through the engine (2 ranks, parameters sharded as rows) against one
process at fp32 tolerance, and its state checkpointed and resumed exactly (tests/train/optimizer_ranks.py)."""

import pytest
import torch

from shardtrain.train.config import load_config
from shardtrain.train.optimizers import MuonWithAdamW, build_optimizer
from shardtrain.train.sections import ConfigError, OptimConfig
from tests.models import split_llama
from tests.train.optimizer_ranks import optimizer_matches_reference_and_resumes


@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor", "muon"])
def test_optimizer_through_the_engine_matches_one_process_and_resumes_exactly(pools, tmp_path, name):
    losses = pools(2).run(optimizer_matches_reference_and_resumes, name, str(tmp_path))
    assert all(len(per_rank) == 6 and len(set(per_rank)) == 6 for per_rank in losses)  # each step moved


def test_muon_orthogonalizes_hidden_matrices_and_adamw_steps_the_rest():
    model = split_llama()
    optimizer = build_optimizer(OptimConfig(name="muon"), model, device=torch.device("cpu"))
    assert isinstance(optimizer, MuonWithAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    by_rule = {
        rule: {names[id(p)] for g in optimizer.param_groups if g["muon"] is rule for p in g["params"]}
        for rule in (True, False)
    }
    assert "layers.0.attn.wq.weight" in by_rule[True] and "layers.1.ffn.w2.weight" in by_rule[True]
    assert {"embed.weight", "head.weight", "norm.weight", "layers.0.attn_norm.weight"} <= by_rule[False]
    assert not by_rule[True] & by_rule[False] and by_rule[True] | by_rule[False] == set(names.values())
    assert {g["momentum"] for g in optimizer.param_groups if g["muon"]} == {0.95}  # Muon's own default


def test_sgd_takes_momentum_and_nesterov():
    model = split_llama()
    cfg = load_config(overrides=["--optim.name", "sgd", "--optim.momentum", "0.8", "--optim.nesterov", "true"]).optim
    optimizer = build_optimizer(cfg, model, device=torch.device("cpu"))
    assert isinstance(optimizer, torch.optim.SGD)
    assert {(g["momentum"], g["nesterov"]) for g in optimizer.param_groups} == {(0.8, True)}


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_low_bit_adamw_is_refused_with_the_reason(name):
    with pytest.raises(ConfigError, match=f"optim.name='{name}' is invalid: torchao's low-bit AdamW quantizes"):
        OptimConfig(name=name)


def test_unknown_optimizer_names_the_choices():
    with pytest.raises(ConfigError, match="optim.name='lion' is invalid: use one of adamw, sgd, adafactor"):
        OptimConfig(name="lion")
