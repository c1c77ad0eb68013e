"""The MFU formula of BENCHMARKS.md against a hand computation, and the spec round trip."""

import argparse

import pytest

from shardtrain.bench.metrics import Stats, mfu, model_flops_per_token, tokens_per_second
from shardtrain.bench.spec import RunSpec, add_spec_arguments, spec_from_args


def spec(size="8b", seq=4096):
    return RunSpec(
        engine="fsdp2", size=size, batch=1, seq=seq, ac=True, steps=10, warmup=3, device="cuda", precision="bf16"
    )


def test_flops_per_token_of_8b_by_hand():
    dim, layers, ffn, vocab, kv = 4096, 32, 14336, 128256, 8 * 128
    block = dim * (2 * dim + 2 * kv) + 3 * dim * ffn + 2 * dim  # wq, wo, wk, wv; w1, w2, w3; two norms
    params_minus_embedding = layers * block + dim + vocab * dim  # + final norm + output head
    assert params_minus_embedding == 7_504_924_672
    expected = 6 * params_minus_embedding + 6 * layers * dim * 4096
    assert model_flops_per_token(spec()) == expected == 48_250_773_504


def test_mfu_reproduces_the_8b_fsdp2_row():
    # torch FSDP2 on 2 x H200, 8.0B, batch 1, activation checkpointing: 6,784 tokens/s/GPU = 41.4% MFU at 790.
    value = mfu(flops_per_token=model_flops_per_token(spec()), tokens_per_s_per_gpu=6784, peak_tflops=790)
    assert value == pytest.approx(48_250_773_504 * 6784 / 790e12)
    assert round(100 * value, 1) == 41.4


def test_mfu_rejects_a_zero_peak():
    with pytest.raises(ValueError, match="peak_tflops"):
        mfu(flops_per_token=1.0, tokens_per_s_per_gpu=1.0, peak_tflops=0)


def test_throughput_and_stats():
    assert tokens_per_second(tokens_per_step=4096, step_ms=[500.0, 1000.0]) == [8192.0, 4096.0]
    assert Stats.of([3.0, 1.0, 2.0]) == Stats(median=2.0, min=1.0, max=3.0)


def test_spec_survives_the_worker_command_line():
    original = RunSpec(
        engine="shardtrain-zero2",
        size="2m",
        batch=3,
        seq=64,
        ac=True,
        steps=4,
        warmup=1,
        device="cpu",
        precision="fp32",
        seed=7,
        shard_world=2,
        profile_steps=2,
        trace_path="/t/x.gz",
        compile=True,
        float8=True,
    )
    parser = argparse.ArgumentParser()
    add_spec_arguments(parser)
    assert spec_from_args(parser.parse_args(original.to_argv())) == original


def test_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="unknown Llama size"):
        spec(size="3b")
    with pytest.raises(ValueError, match="precision"):
        RunSpec(engine="ddp", size="2m", batch=1, seq=8, ac=False, steps=1, warmup=0, device="cpu", precision="fp8")
