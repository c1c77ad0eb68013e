"""Behaviour of st.shard beyond parity: memory, meta init, state dicts, errors, policies."""

import pytest
import torch
from torch import nn

import shardtrain as st
from shardtrain.models.llama import Block, Llama, llama_config
from tests.core import checks
from tests.models import ConvNet, tiny_llama

WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]  # the default tier keeps worlds 1-2


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("strategy", ["full_shard", "optimizer_only"])
def test_sharded_state_is_one_over_the_world_size(pools, strategy, world):
    one = pools(1).run(checks.state_bytes, strategy)[0]
    sharded = pools(world).run(checks.state_bytes, strategy)
    assert max(sharded) <= (1 / world + 0.01) * one, (sharded, one)


@pytest.mark.parametrize("world", WORLDS)
def test_replicated_state_is_whole_at_any_world_size(pools, world):
    one = pools(1).run(checks.state_bytes, "no_shard")[0]
    no_shard = pools(world).run(checks.state_bytes, "no_shard")
    assert min(no_shard) >= 0.99 * one


def test_meta_init_materialises_unit_by_unit(pools):
    out = pools(2).run(checks.meta_init_is_unit_by_unit)
    for r in out:
        assert r["norms_ok"] and r["rope_ok"]
        assert r["max_live"] < 0.5 * r["total"], r  # never the whole model at once
    assert out[0]["checksum"] == out[1]["checksum"]  # every rank built the same weights
    assert out[0]["loss"] == pytest.approx(out[1]["loss"], rel=0.5)


def test_sync_module_states_takes_rank_zero_values(pools):
    assert pools(2).run(checks.synced_states) == [0.0, 0.0]


def test_full_state_dict_loads_into_plain_model(pools):
    rank0, rank1 = pools(2).run(checks.full_state_dict_roundtrip)
    assert rank0 == {"keys": True, "outputs": True, "tied": True}
    assert rank1 == {"empty": True}


def test_load_full_state_dict_into_a_sharded_model(pools):
    for r in pools(2).run(checks.load_full_state_dict_roundtrip):
        assert r == {"equal": True, "mis_shaped_named": True}, r


def test_unused_frozen_and_eval(pools):
    for r in pools(2).run(checks.unused_and_eval_behaviour):
        assert all(r.values()), r


def test_collectives_per_step(pools):
    for r in pools(2).run(checks.collective_counts):
        units = r["units"]
        for step in r["steps"]:
            # forward gathers every unit, backward gathers each again; one reduce-scatter per unit
            assert {k: step[k] for k in ("gather", "reduce")} == {"gather": 2 * units, "reduce": units}, r
            # the order check: at most one small exchange per hook that communicates (each unit's
            # pre-forward, pre-backward and post-backward, the end of backward), never one per collective
            assert 2 * units <= step["announce"] <= 3 * units + 1, r


def test_groups_made_by_shard_keep_the_timeout_of_the_group_given_and_are_made_once(pools):
    for r in pools(2).run(checks.subgroups_keep_the_timeout):
        assert r == {"order": 17.0, "control": 17.0, "hybrid_shard": 17.0, "hybrid_replicate": 17.0, "reused": True}, r


def test_small_modules_get_no_hooks(pools):
    assert pools(1).run(checks.rmsnorm_is_merged) == [True]


def test_plan_one_unit_per_block_plus_root():
    with torch.device("meta"):
        model = Llama(llama_config("1.5b"))
    plan = st.plan(model, wrap={Block}, world_size=2, mixed_precision="bf16")
    assert [u.name for u in plan.units] == [""] + [f"layers.{i}" for i in range(16)]
    assert plan.total_params == model.cfg.num_params()
    text = str(plan)
    assert "layers.15" in text and "<root>" in text and "MiB/rank sharded" in text
    block = plan.units[1]
    assert block.sharded_bytes == block.padded // 2 * 4 and block.unsharded_bytes == block.padded * 2
    assert not plan.warnings


def test_plan_warns_when_one_unit_dominates():
    plan = st.plan(tiny_llama(), wrap=None, world_size=4)
    assert len(plan.units) == 1 and "sharding will save little" in plan.warnings[0]


def test_plan_size_policy_and_tied_weights():
    plan = st.plan(ConvNet(), wrap=st.SizePolicy(min_params=150), world_size=3)
    assert len(plan.units) > 1
    tied = st.plan(tiny_llama(), wrap={nn.Embedding, Block}, world_size=2)
    assert any("embed.weight" in n and "head.weight" in n for n in tied.notes)
    assert "embed" not in [u.name for u in tied.units]  # left without parameters by the tie: no unit


def test_llama_shard_units_split_the_root():
    """SHARD_UNITS gives the embedding and the output head units of their own (the root keeps the
    final norm); with tied embeddings both move into the root and get no unit."""
    from shardtrain.models.llama import SHARD_UNITS, Llama, LlamaConfig

    untied = st.plan(Llama(LlamaConfig(n_layers=2)), wrap=SHARD_UNITS, world_size=2)
    assert [u.name for u in untied.units] == ["", "embed", "layers.0", "layers.1", "head"]
    tied = st.plan(Llama(LlamaConfig(n_layers=2, tie_embeddings=True)), wrap=SHARD_UNITS, world_size=2)
    assert [u.name for u in tied.units] == ["", "layers.0", "layers.1"]
    # Sharded, the embedding looks its rows up and holds no unsharded copy; unsharded, it gathers.
    by_name = {u.name: u for u in untied.units}
    assert by_name["embed"].unsharded_bytes == 0 and by_name["head"].unsharded_bytes == by_name["head"].padded * 4
    assert any("'embed' is an nn.Embedding" in note for note in untied.notes)
    replicated = st.plan(Llama(LlamaConfig(n_layers=2)), wrap=SHARD_UNITS, world_size=2, strategy="no_shard")
    assert replicated.units[1].unsharded_bytes == replicated.units[1].padded * 4 and not replicated.notes


@pytest.mark.parametrize(
    "policy, message",
    [
        ({nn.Conv2d}, "wrap={Conv2d} matches no module of Llama; the model contains"),
        (st.SizePolicy(min_params=10**9), "lower min_params"),
        (42, "is not a policy"),
    ],
)
def test_bad_wrap_policy(policy, message):
    with pytest.raises((ValueError, TypeError), match=message):
        st.plan(tiny_llama(), wrap=policy, world_size=2)


def test_strategy_names():
    from torch.distributed.fsdp import ShardingStrategy

    from shardtrain.strategy import Strategy, parse_strategy

    assert parse_strategy("FULL_SHARD") is Strategy.FULL_SHARD
    assert parse_strategy(ShardingStrategy.SHARD_GRAD_OP) is Strategy.SHARD_GRAD_OP
    assert parse_strategy("no_shard") is Strategy.NO_SHARD
    with pytest.raises(ValueError, match="unknown sharding strategy 'zero4'; use one of"):
        parse_strategy("zero4")


def test_bad_mixed_precision_and_size_policy():
    from shardtrain.policy import parse_mixed_precision

    with pytest.raises(ValueError, match="mixed_precision='bf15' is not understood"):
        parse_mixed_precision("bf15")
    with pytest.raises(ValueError, match="min_params must be a positive int"):
        st.SizePolicy(min_params=0)


def test_shard_errors(pools):
    out = pools(2).run(_shard_errors)
    assert out[0] == out[1]
    for name, message in out[0].items():
        assert message is not None, name


def _shard_errors() -> dict:
    cases = {}

    def expect(name, fn, cls, text):
        try:
            fn()
        except cls as e:
            cases[name] = str(e) if text in str(e) else None
        else:
            cases[name] = None

    expect("not a module", lambda: st.shard(object()), TypeError, "expects an nn.Module")
    expect("strategy", lambda: st.shard(tiny_llama(), strategy="zero9"), ValueError, "unknown sharding strategy")
    model = st.shard(tiny_llama(), wrap={Block})
    expect("twice", lambda: st.shard(model), ValueError, "already sharded")
    expect("mesh", lambda: st.shard(tiny_llama(), mesh=(1, 2)), ValueError, "only used by hybrid_shard")

    class NoReset(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w

    with torch.device("meta"):
        meta = NoReset()
    expect(
        "meta",
        lambda: st.shard(meta),
        ValueError,
        "has no reset_parameters() to fill them; give it one, or pass param_init_fn",
    )
    expect("unsharded", lambda: st.clip_grad_norm_(tiny_llama(), 1.0), ValueError, "is not sharded")
    return cases


def test_auto_strategy_chooses_and_trains(pools):
    out = pools(2).run(checks.auto_strategy, "8GiB")
    assert out[0]["strategy"] == out[1]["strategy"] in {"full_shard", "shard_grad_op", "optimizer_only", "no_shard"}
    assert out[0]["losses"][-1] < out[0]["losses"][0]


def test_auto_strategy_needs_a_sequence_length(pools):
    assert "st.AutoPolicy(micro_batch=..., seq_len=...)" in pools(1).run(_auto_without_seq_len)[0]


def _auto_without_seq_len() -> str:
    try:
        st.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), strategy="auto", wrap={nn.Linear})
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "option, message",
    [
        ({"param_init_fn": 5}, "param_init_fn=5: pass a callable(module) that fills its parameters, or None"),
        (
            {"process_group": "world"},
            "process_group='world': pass a torch.distributed ProcessGroup (dist.new_group(ranks)), or None for every rank",
        ),
        ({"sync_module_states": "no"}, "sync_module_states='no': use True or False"),
        ({"forward_prefetch": "no"}, "forward_prefetch='no': use True or False"),
        ({"limit_all_gathers": None}, "limit_all_gathers=None: use True or False"),
        (
            {"backward_prefetch": "pre"},
            "backward_prefetch='pre': use torch's BackwardPrefetch.BACKWARD_PRE or BACKWARD_POST, True, False or None",
        ),
    ],
)
def test_an_option_of_the_wrong_type_is_one_line_naming_it(option, message):
    """Checked before anything else (no process group needed): one line with the value and the accepted ones."""
    with pytest.raises(TypeError) as info:
        st.shard(tiny_llama(), **option)
    assert str(info.value) == message


def test_torch_prefetch_switches_still_translate():
    from torch.distributed.fsdp import BackwardPrefetch

    from shardtrain.compat import translate_torch_options

    def prefetch(**options):
        return translate_torch_options(options, given=set())["prefetch"]

    assert prefetch(forward_prefetch=False, backward_prefetch=None) == 0
    assert prefetch(backward_prefetch=BackwardPrefetch.BACKWARD_PRE) == 1
    assert prefetch(forward_prefetch=True, limit_all_gathers=False) == 2
