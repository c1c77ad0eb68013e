"""DPO's reference model in the memory bill: a full fine-tune's frozen copy, and nothing otherwise."""

import pytest

import shardtrain as st
from shardtrain.train.config import load_config
from shardtrain.train.planned_config import resolve_auto_config

COMMON = dict(world_size=8, micro_batch=4, seq_len=1024, precision="bf16-mixed")


def test_a_frozen_copy_adds_its_bf16_shard_to_every_moment():
    plain = st.estimate_memory("1.5b", **COMMON)
    dpo = st.estimate_memory("1.5b", reference="frozen_copy", **COMMON)
    copy = plain.inputs.model.num_params * 2 // 8
    assert dpo.total - plain.total == copy
    assert [t for _, t in dpo.phase_totals] == [t + copy for _, t in plain.phase_totals]
    assert "frozen reference copy" in dpo.notes[-1]
    assert st.estimate_memory("1.5b", reference="none", **COMMON).total == plain.total


def test_an_unknown_reference_names_the_choices():
    with pytest.raises(ValueError, match="reference='copy' is invalid: use 'none'"):
        st.estimate_memory("1.5b", reference="copy", **COMMON)


@pytest.mark.parametrize(
    "extra, sequences",
    [([], 8), (["--train.objective", "dpo"], 16), (["--train.objective", "dpo", "--dpo.precompute_ref", "true"], 16)],
)
def test_the_automatic_plan_bills_two_rows_a_pair_and_the_copy(extra, sequences):
    cfg = load_config(
        None,
        ["--model.name", "llama-125m", "--engine.strategy", "auto", "--engine.devices", "2", "--engine.accelerator",
         "cpu", *extra],
    )  # fmt: skip
    _, choice = resolve_auto_config(cfg, device_memory=2**33)
    assert choice.micro_batch * choice.grad_accum == sequences
