"""The memory estimator: hand-computed bills, strategy ordering, inputs, errors, the CLI."""

import argparse
import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import shardtrain as st
from shardtrain.cli import estimate as cli_estimate
from shardtrain.models.llama import Llama, llama_config
from shardtrain.planning.cost.compare import compare_strategies
from shardtrain.planning.cost.estimate import OVERHEAD_BYTES
from shardtrain.planning.cost.sizes import GiB, parse_bytes, parse_count

# 8b: dim 4096, 32 layers, 32 heads / 8 kv, ffn 14336, vocab 128256 (untied)
P8 = 8_030_261_248
TABLE8 = 128256 * 4096  # the embedding, and the output head (untied)
ROOT8 = 4096  # the final norm: embedding and head are units of their own (models.llama.SHARD_UNITS)
BLOCK8 = 4096 * (2 * 4096 + 2 * 1024) + 3 * 4096 * 14336 + 2 * 4096
# 1.5b: dim 2048, 16 layers, 16 heads / 8 kv, ffn 8192, vocab 128256
P15 = 1_532_037_120


def test_model_state_arithmetic_by_hand():
    assert 32 * BLOCK8 + 2 * TABLE8 + ROOT8 == P8
    e = st.estimate_memory("8b", world_size=2, activation_checkpointing=True)
    spec = e.inputs.model
    assert (spec.root_params, spec.unit_params, spec.lookup_params) == (
        ROOT8,
        (TABLE8, *[BLOCK8] * 32, TABLE8),
        (TABLE8,),
    )
    # AdamW with fp32 master weights: 4 (param) + 4 (grad) + 8 (moments) = 16 B/param, sharded over 2.
    assert e.parameters == P8 * 4 // 2
    assert e.optimizer_state == P8 * 8 // 2
    # The peak is the end of backward: the root (the final norm) reduces last. Its bf16 grads are
    # copied into an fp32 reduce buffer while the largest gathering unit's (the head's) is still held;
    # the embedding looks its rows up in place, so it has no unsharded gradient or reduce buffer.
    assert e.peak_phase == "backward end"
    assert e.gradients == (P8 - ROOT8) * 4 // 2
    assert e.unsharded_grads == ROOT8 * 2
    assert e.reduce_buffers == ROOT8 * 4 + TABLE8 * 4
    assert e.activations == 0 and e.logits == 0 and e.unsharded_params == 0
    assert e.total == P8 * 16 // 2 + 4 * ROOT8 + 4 * TABLE8 + OVERHEAD_BYTES


def test_loss_phase_by_hand():
    e = st.estimate_memory("1.5b", world_size=2, micro_batch=2)
    tokens, h, kv, f, heads = 2 * 4096, 2048, 1024, 8192, 16
    per_block = tokens * (2 * (4 * h + 3 * h + 2 * kv + 4 * f) + 4 * heads + 8)  # bf16 + fp32 stats
    assert e.peak_phase == "forward + loss"
    assert e.activations == 16 * per_block + 2 * 2 * tokens * h  # + final norm input/output
    assert e.logits == 12 * tokens * 128256  # fp32 log-probs, their grad, the logits' grad
    assert e.parameters == P15 * 4 // 2 and e.optimizer_state == P15 * 8 // 2
    assert e.gradients == 0 and e.unsharded_params == 0  # grads freed by zero_grad; root resharded
    kept = st.estimate_memory("1.5b", world_size=2, micro_batch=2, keep_grads=True)
    assert kept.gradients == P15 * 4 // 2 and kept.total == e.total + P15 * 2
    every2 = st.estimate_memory("1.5b", world_size=2, micro_batch=2, activation_checkpointing=2)
    checkpoint = 2 * tokens * h  # a checkpointed block keeps only its bf16 input
    assert every2.activations == 8 * per_block + 8 * checkpoint + 2 * 2 * tokens * h


# torch FSDP2's peaks on 2 x H200 (BENCHMARKS.md, "Memory estimator against measured peaks", the calibration
# table): model, micro-batch, checkpointing, strategy, GiB
FSDP2_PEAKS = [
    ("1.5b", 2, False, "full_shard", 33.1),
    ("1.5b", 2, False, "shard_grad_op", 34.8),
    ("8b", 1, True, "full_shard", 64.8),
    ("8b", 1, False, "full_shard", 74.8),
    ("8b", 2, True, "full_shard", 64.8),
    ("12b", 1, True, "full_shard", 98.3),
    ("14b", 1, True, "full_shard", 114.8),
]


@pytest.mark.parametrize("name,batch,ac,strategy,gib", FSDP2_PEAKS)
def test_calibrated_against_fsdp2_peaks(name, batch, ac, strategy, gib):
    e = st.estimate_memory(name, world_size=2, strategy=strategy, micro_batch=batch, activation_checkpointing=ac)
    assert abs(e.total / GiB / gib - 1) < 0.05


def test_strategy_ordering():
    kw = dict(world_size=4, micro_batch=1)
    by = {
        s: st.estimate_memory("8b", strategy=s, **kw)
        for s in ("full_shard", "shard_grad_op", "optimizer_only", "no_shard")
    }
    states = [e.model_states for e in by.values()]
    assert states[0] == states[1] == states[2] < states[3]
    step = [dict(e.phase_totals)["optimizer step"] for e in by.values()]  # persistent memory
    assert step[0] == step[1] < step[2] < step[3]
    totals = [e.total for e in by.values()]
    assert totals == sorted(totals)
    assert by["no_shard"].parameters == P8 * 4 and by["no_shard"].optimizer_state == P8 * 8
    # Every unit kept unsharded until its backward, but the embedding, which never gathers.
    assert by["shard_grad_op"].unsharded_params == (P8 - TABLE8) * 2


def test_the_embedding_gathers_only_where_it_cannot_look_up_in_place():
    sharded = st.estimate_memory("8b", world_size=2, strategy="shard_grad_op")
    assert sharded.unsharded_params == (P8 - TABLE8) * 2
    # One rank, or the table offloaded to the host: the embedding is gathered like any unit.
    alone = st.estimate_memory("8b", world_size=1, strategy="shard_grad_op", precision="bf16")
    assert alone.unsharded_params == P8 * 2
    offloaded = st.estimate_memory("8b", world_size=2, strategy="shard_grad_op", cpu_offload=True)
    assert offloaded.unsharded_params == P8 * 2
    # Tied embeddings: the table is the root's (lookup and head share it), as SHARD_UNITS cuts it.
    cfg = llama_config("tiny", tie_embeddings=True)
    with torch.device("meta"):
        tied = st.estimate_memory(Llama(cfg), world_size=2).inputs.model
    by_shape = st.estimate_memory(cfg, world_size=2).inputs.model
    assert tied.lookup_params == by_shape.lookup_params == ()
    assert (tied.root_params, tied.unit_params) == (by_shape.root_params, by_shape.unit_params)


def test_hybrid_shards_within_the_group():
    hybrid = st.estimate_memory("8b", world_size=8, strategy="hybrid_shard", shard_size=2)
    full2 = st.estimate_memory("8b", world_size=2)
    assert hybrid.total == full2.total and hybrid.inputs.label == "hybrid_shard(2)"


def test_activation_checkpointing_reduces_activations():
    acts = {}
    for ac in (False, 4, 2, True):
        e = st.estimate_memory("8b", world_size=2, micro_batch=2, activation_checkpointing=ac)
        acts[ac] = dict(e.phase_totals)["forward + loss"]
    assert acts[False] > acts[4] > acts[2] > acts[True]
    # 0 and 1 are none and every block, as recompute_policy and the automatic plan count them
    assert st.estimate_memory("8b", world_size=2, activation_checkpointing=0).inputs.recompute_every == 0
    assert st.estimate_memory("8b", world_size=2, activation_checkpointing=1).inputs.recompute_every == 1


def test_offload_moves_states_to_host():
    base = st.estimate_memory("8b", world_size=4)
    off = st.estimate_memory("8b", world_size=4, cpu_offload=True)
    assert off.parameters == off.gradients == off.optimizer_state == 0
    assert off.host == P8 * 16 // 4
    assert off.total < base.total
    # Partial offload: whole units from the end of the plan order until at least the share is on the host.
    half = st.estimate_memory("8b", world_size=4, cpu_offload=st.CPUOffload(fraction=0.5))
    spec = half.inputs.model
    sizes = [spec.root_params, *spec.unit_params]
    # the head 525M + the last 17 blocks of 218M >= 4.015B; the root (norm), the embedding and 15 blocks stay
    on_host = TABLE8 + 17 * BLOCK8
    assert st.CPUOffload(fraction=0.5).select(sizes) == [False] * 17 + [True] * 18
    assert on_host >= P8 / 2 > on_host - BLOCK8
    assert half.host == pytest.approx(off.host * on_host / P8, rel=1e-6)
    # What stays on the device: the other units' fp32 shards (4 B) and Adam moments (8 B) per parameter / 4.
    assert half.parameters == pytest.approx(off.host * (P8 - on_host) / P8 / 4, rel=1e-6)
    assert half.optimizer_state == pytest.approx(2 * half.parameters, rel=1e-6)
    assert off.total < half.total < base.total
    # The engine offloads parameters and optimizer state together; the estimator says so too.
    with pytest.raises(ValueError, match="offloaded together"):
        st.estimate_memory("8b", world_size=4, cpu_offload=st.CPUOffload(params=False, optimizer=True))


def test_offloaded_units_kept_from_forward_to_backward():
    """CPUOffload(reshard_after_forward=False): the offloaded units' bf16 parameters (2 B each, whole on
    every rank) stay on the device from forward to backward; the resident units still reshard."""
    kwargs = dict(world_size=4, precision="bf16", micro_batch=1, seq_len=4096)
    half = st.estimate_memory("8b", cpu_offload=st.CPUOffload(fraction=0.5), **kwargs)
    kept = st.estimate_memory("8b", cpu_offload=st.CPUOffload(fraction=0.5, reshard_after_forward=False), **kwargs)
    on_host = TABLE8 + 17 * BLOCK8  # test_offload_moves_states_to_host names these units
    assert kept.unsharded_params - half.unsharded_params == on_host * 2
    assert kept.total - half.total == on_host * 2
    assert kept.host == half.host and kept.parameters == half.parameters
    # shard_grad_op keeps every unit already: the offload's setting adds nothing
    sgo = dict(kwargs, strategy="shard_grad_op")
    assert (
        st.estimate_memory("8b", cpu_offload=st.CPUOffload(fraction=0.5, reshard_after_forward=False), **sgo).total
        == st.estimate_memory("8b", cpu_offload=st.CPUOffload(fraction=0.5), **sgo).total
    )


def test_largest_micro_batch_is_monotone_and_tight():
    e = st.estimate_memory("8b", world_size=2)
    sizes = [e.largest_micro_batch(f"{g}GiB") for g in (60, 80, 100, 139, 200)]
    assert sizes == sorted(sizes) and sizes[0] == 0 and sizes[-1] > 1
    best = e.largest_micro_batch("139GiB")
    assert e.with_micro_batch(best).fits("139GiB") and not e.with_micro_batch(best + 1).fits("139GiB")


def test_input_forms_agree():
    by_name = st.estimate_memory("8b", world_size=2)
    by_config = st.estimate_memory(llama_config("8b"), world_size=2)
    hf = SimpleNamespace(
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        vocab_size=128256,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    by_hf = st.estimate_memory(hf, world_size=2)
    by_hints = st.estimate_memory(
        params=P8, dim=4096, layers=32, vocab=128256, ffn=14336, heads=32, kv_heads=8, world_size=2
    )
    assert by_name.total == by_config.total == by_hints.total
    # Hugging Face's RMSNorm keeps an fp32 copy of its input and its bf16 normalised input (4 + 2 bytes per
    # element where F.rms_norm keeps the bf16 input): 4 more bytes per element in 2 norms per block and the final
    assert by_hf.total - by_name.total == (2 * 32 + 1) * 4 * 4096 * 4096


def test_parameter_count_with_defaults():
    e = st.estimate_memory("7B", world_size=4)
    assert e.inputs.model.num_params == 7_000_000_000
    shape = e.inputs.model.shape
    assert shape.dim % 1024 == 0 and shape.n_kv_heads == 8 and shape.vocab_size == 128256
    assert abs(shape.num_params / 7e9 - 1) < 0.05
    assert st.estimate_memory(params=7e9, world_size=4).total == e.total


@pytest.mark.parametrize("vocab, split", [(256, False), (1024, True)])
def test_meta_module(vocab, split):
    # tiny's block: 46,208 parameters; its table: 64 x vocab (16,384 or 65,536).
    cfg = llama_config("tiny", vocab_size=vocab)
    with torch.device("meta"):
        model = Llama(cfg)
    e = st.estimate_memory(model, world_size=2)
    spec = e.inputs.model
    assert spec.num_params == cfg.num_params() and len(spec.unit_params) == cfg.n_layers + 2 * split
    # A Llama module is planned as its config is: blocks, and the embedding and head as units of their
    # own (the final norm the root's) once the table is at least a block's size.
    from_config = st.estimate_memory(cfg, world_size=2)
    table = cfg.vocab_size * cfg.dim
    assert spec.lookup_params == ((table,) if split else ())
    assert spec.root_params == (cfg.dim if split else 2 * table + cfg.dim)
    assert (spec.unit_params, spec.lookup_params) == (
        from_config.inputs.model.unit_params,
        from_config.inputs.model.lookup_params,
    )
    assert e.total == from_config.total


def test_generic_meta_module():
    with torch.device("meta"):
        generic = nn.Sequential(nn.Embedding(1000, 64), nn.ModuleList(nn.Linear(64, 64) for _ in range(3)))
    bare = st.estimate_memory(generic, world_size=2)
    assert bare.activations == bare.logits == 0 and "not estimated" in bare.notes[0]
    assert bare.inputs.model.unit_params == (64 * 64 + 64,) * 3
    with pytest.raises(ValueError, match="shape hints"):
        bare.largest_micro_batch("80GiB")
    hinted = st.estimate_memory(generic, world_size=2, dim=64, seq_len=128)
    assert hinted.inputs.model.shape.vocab_size == 1000 and hinted.inputs.model.shape.n_layers == 3
    assert dict(hinted.phase_totals)["forward + loss"] > dict(bare.phase_totals)["forward + loss"]


def test_tied_and_frozen_parameters():
    with torch.device("meta"):
        model = Llama(llama_config("tiny", tie_embeddings=True))
    model.layers[0].requires_grad_(False)
    spec = st.estimate_memory(model, world_size=1).inputs.model
    assert spec.num_params == llama_config("tiny", tie_embeddings=True).num_params()
    assert spec.trainable_params == spec.num_params - sum(p.numel() for p in model.layers[0].parameters())


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: st.estimate_memory("9x", world_size=2), r"'9x' is neither a built-in name"),
        (lambda: st.estimate_memory(world_size=2), "no model given"),
        (lambda: st.estimate_memory("8b", params="7B", world_size=2), "params='7B'"),
        (lambda: st.estimate_memory("8b", world_size=0), "world_size=0 must be a positive integer"),
        (
            lambda: st.estimate_memory("8b", world_size=2, activation_checkpointing="yes"),
            "activation_checkpointing='yes'",
        ),
        (lambda: st.estimate_memory("8b", world_size=8, strategy="hybrid_shard"), "needs shard_size="),
        (
            lambda: st.estimate_memory("8b", world_size=8, strategy="hybrid_shard", shard_size=3),
            "must divide world_size=8",
        ),
        (lambda: st.estimate_memory("8b", world_size=2, optimizer="lion"), "optimizer='lion'.*bytes per parameter"),
        (lambda: st.estimate_memory("8b", world_size=2, device_memory="80XB"), "'80XB'.*80GiB"),
        (lambda: st.estimate_memory("8b", world_size=2, strategy="zero4"), "unknown sharding strategy 'zero4'"),
        (lambda: st.estimate_memory("8b", world_size=2, width=3), r"unknown shape hints \['width'\]"),
        (lambda: st.estimate_memory(params="1M", world_size=2), "leaves nothing for .* blocks"),
        (lambda: st.estimate_memory(object(), world_size=2), "is not understood"),
        (lambda: st.estimate_memory("8b", world_size=2, wrap={nn.Linear}), "applies only to an nn.Module"),
        (
            lambda: st.estimate_memory(SimpleNamespace(hidden_size=8, num_hidden_layers=2), world_size=2),
            r"lacks \['vocab_size'\]",
        ),
    ],
)
def test_bad_inputs_name_the_value_and_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_sizes():
    assert parse_count("1.5b") == 1_500_000_000 and parse_count("350M") == 350_000_000 and parse_count(7e9) == 7e9
    assert parse_bytes("80GiB") == 80 * GiB and parse_bytes("141GB") == 141 * 10**9 and parse_bytes("80G") == 80 * GiB


def test_printed_bill_and_comparison():
    text = str(st.estimate_memory("8b", world_size=2, activation_checkpointing=True, device_memory="141GB"))
    for item in (
        "parameters (fp32 master)",
        "optimizer state (adamw)",
        "reduce buffers (fp32)",
        "total (peak allocated)",
        "peak during backward end",
        "largest micro-batch",
    ):
        assert item in text
    table = str(compare_strategies("8b", world_size=4, device_memory="80GiB"))
    header = next(line for line in table.splitlines() if line.startswith("GiB per device"))
    assert header.split()[-5:] == ["full_shard", "shard_grad_op", "optimizer_only", "no_shard", "hybrid_shard(2)"]
    assert "largest micro-batch" in table
    assert "hybrid" not in str(compare_strategies("8b", world_size=2))  # no group between 1 and 2


def _cli(argv):
    parser = argparse.ArgumentParser(prog="shardtrain")
    cli_estimate.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_prints_every_strategy(capsys):
    assert _cli(["estimate", "--params", "7B", "--gpus", "4", "--device-memory", "80GiB", "--ac", "2"]) == 0
    out = capsys.readouterr().out
    for label in (
        "full_shard",
        "shard_grad_op",
        "optimizer_only",
        "no_shard",
        "hybrid_shard(2)",
        "largest micro-batch",
    ):
        assert label in out
    assert "device memory: 80.00 GiB (given)" in out and "1 block in 2" in out


def test_cli_single_strategy_and_hf_config(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "hidden_size": 2048,
                "num_hidden_layers": 16,
                "intermediate_size": 8192,
                "vocab_size": 128256,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
            }
        )
    )
    assert _cli(["estimate", "--model", str(config), "--gpus", "2", "--strategy", "full_shard", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "strategy full_shard" in out and "peak during forward + loss" in out and "device memory:" in out


def test_cli_errors(capsys):
    assert _cli(["estimate", "--gpus", "2"]) == 2
    assert "no model" in capsys.readouterr().err
    assert _cli(["estimate", "--params", "7Q", "--gpus", "2"]) == 2
    assert "'7Q'" in capsys.readouterr().err


def test_disk_tier_moves_the_optimizer_state_from_host_to_disk(tmp_path):
    """CPUOffload(disk_dir=...): the offloaded AdamW state (8 bytes per parameter, per process) is in
    the files; host memory keeps the shards and gradients; the device is unchanged."""
    host = st.estimate_memory("8b", world_size=2, cpu_offload=True)
    disk = st.estimate_memory("8b", world_size=2, cpu_offload=st.CPUOffload(disk_dir=str(tmp_path)))
    assert host.disk == 0 and disk.disk == host.inputs.model.trainable_params * 8 // 2 == pytest.approx(
        host.host / 2, rel=1e-3
    )
    assert disk.host + disk.disk == host.host and disk.total == host.total
    assert "disk (offloaded state)" in str(disk) and "disk (offloaded state)" not in str(host)
