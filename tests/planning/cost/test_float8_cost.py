"""float8 in the memory estimate (planning/cost/float8_cost.py): the Linears counted by ops/float8.py's
rule from a shape match what it converts on the module, the bill adds only the largest matmul's float8
copies, the refusals, and the CLI and `shardtrain plan` lines."""

import argparse

import pytest
import torch

import shardtrain as st
from shardtrain import cli
from shardtrain.cli import estimate as cli_estimate
from shardtrain.float8_rule import float8_linear_names
from shardtrain.models.llama import Llama, llama_config


def _meta_llama(size: str) -> Llama:
    with torch.device("meta"):
        return Llama(llama_config(size))


@pytest.mark.parametrize(("size", "count"), [("1.5b", 16 * 5), ("8b", 32 * 5)])  # q, o, gate, up, down a block
def test_the_count_from_the_shape_is_what_the_module_converts(size, count):
    module = _meta_llama(size)
    assert len(float8_linear_names(module)) == count
    for model in (size, module):
        assert st.estimate_memory(model, world_size=1, float8=True).inputs.float8.count == count


def test_the_bill_adds_the_largest_matmuls_float8_copies_and_nothing_else():
    common = dict(world_size=2, activation_checkpointing=True, micro_batch=2, seq_len=2048)
    plain = st.estimate_memory("8b", **common)
    f8 = st.estimate_memory("8b", float8=True, **common)
    tokens = 2 * 2048
    # the gate/up/down matmuls (4096 x 14336): input + output gradient per token, and the weight, 1 B each
    copies = tokens * (4096 + 14336) + 4096 * 14336
    assert f8.overhead - plain.overhead == copies == 134_217_728
    assert f8.total - plain.total == copies and f8.activations == plain.activations
    assert f8.with_micro_batch(4).overhead - plain.with_micro_batch(4).overhead == copies + tokens * (4096 + 14336)
    assert any(n.startswith("float8: 160 Linears train in float8") and "0.12 GiB" in n for n in f8.notes)
    assert not any("float8" in n for n in plain.notes)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(float8=True, tp=2, world_size=2), r"float8=True with tp=2: .* pass tp=1 or float8=False"),
        (
            dict(float8=True, lora_rank=8, base_bits=4, world_size=1),
            r"float8=True with base_bits=4: .* \(QLoRA\) .* pass float8=False, or base_bits=16",
        ),
        (dict(float8="yes", world_size=1), r"float8='yes' is invalid: use True or False"),
    ],
)
def test_refusals_name_the_values_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        st.estimate_memory("8b", **kwargs)


def test_a_model_with_no_large_linear_is_refused():
    with pytest.raises(ValueError, match=r"float8=True: no Linear of .* converts .* estimate it with float8=False"):
        st.estimate_memory("125m", world_size=1, float8=True)  # dim 768 < 1024


def test_cli_estimate_and_plan_say_float8_is_on(capsys):
    parser = argparse.ArgumentParser(prog="shardtrain")
    cli_estimate.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["estimate", "--model", "1.5b", "--gpus", "1", "--strategy", "full_shard", "--float8"])
    assert args.func(args) == 0
    assert "note: float8: 80 Linears train in float8 (float8_rule.py's rule)" in capsys.readouterr().out
    plan = ["plan", "--model.name", "llama-1.5b", "--engine.accelerator", "cuda", "--engine.devices", "1"]
    plan += ["--data.seq_len", "256", "--train.batch_size", "1"]
    float8 = ["--train.float8", "true", "--train.compile", "true", "--device-memory", "80GB"]
    assert cli.main([*plan, *float8, "--auto"]) == 0  # the automatic plan weighs float8 too
    out = capsys.readouterr().out
    assert "== automatic plan ==" in out and "note: float8: 80 Linears train in float8" in out
    assert cli.main([*plan, "--device-memory", "80GB"]) == 0
    assert "float8" not in capsys.readouterr().out


def test_the_step_time_divides_compute_and_recompute_by_the_measured_ratio():
    from shardtrain.planning.cost.candidates import predicted_time
    from shardtrain.planning.cost.speed import FLOAT8_SPEEDUP

    common = dict(world_size=2, activation_checkpointing=True, micro_batch=2, seq_len=4096)
    plain = predicted_time(st.estimate_memory("8b", **common), grad_accum=2)
    f8 = predicted_time(st.estimate_memory("8b", float8=True, **common), grad_accum=2)
    assert f8.compute == pytest.approx(plain.compute / FLOAT8_SPEEDUP, rel=1e-12) and f8.compute < plain.compute
    assert f8.recompute == pytest.approx(plain.recompute / FLOAT8_SPEEDUP, rel=1e-12) and plain.recompute > 0
    assert (f8.gathers, f8.overhead, f8.tokens) == (plain.gathers, plain.overhead, plain.tokens)
