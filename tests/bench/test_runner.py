"""The runner's plan: engines interleaved and rotated per repeat, the ideal first, profiling once."""

import os

import pytest

import shardtrain
from shardtrain.bench.runner import BenchOptions, child_environment, planned_runs


def options(**overrides):
    base = dict(
        sizes=("tiny", "2m"),
        engines=("shardtrain", "fsdp2", "ddp"),
        batch=2,
        seq=None,
        ac=False,
        steps=2,
        warmup=1,
        repeats=2,
        nproc=2,
        device="cpu",
        precision="fp32",
        peak_tflops=None,
    )
    return BenchOptions(**{**base, **overrides})


def test_engines_interleaved_and_rotated_per_repeat():
    plan = planned_runs(options())
    order = [(spec.size, spec.engine, repeat) for spec, _, repeat in plan]
    assert order == [
        ("tiny", "shardtrain", 0),
        ("tiny", "fsdp2", 0),
        ("tiny", "ddp", 0),
        ("tiny", "fsdp2", 1),
        ("tiny", "ddp", 1),
        ("tiny", "shardtrain", 1),
        ("2m", "shardtrain", 0),
        ("2m", "fsdp2", 0),
        ("2m", "ddp", 0),
        ("2m", "fsdp2", 1),
        ("2m", "ddp", 1),
        ("2m", "shardtrain", 1),
    ]
    assert plan[0][0].seq == 128 and plan[6][0].seq == 256  # each size's own max_seq_len by default


def test_ideal_runs_first_in_one_process_and_profiling_only_in_the_first_repeat():
    plan = planned_runs(options(sizes=("tiny",), ideal=True, profile_steps=2, trace_dir="/traces"))
    ideal, *engines = plan
    assert len(engines) == 6 and all(spec.engine != "ideal" for spec, _, _ in engines)
    assert ideal[0].engine == "ideal" and ideal[1] == 1 and ideal[0].shard_world == 2
    assert ideal[0].profile_steps == 2 and ideal[0].trace_path == "/traces/trace_tiny_ideal.json.gz"
    profiled = [spec for spec, _, repeat in engines if spec.profile_steps]
    assert [s.engine for s in profiled] == ["shardtrain", "fsdp2", "ddp"]
    assert profiled[0].trace_path == "/traces/trace_tiny_shardtrain.json.gz"
    assert all(not spec.profile_steps for spec, _, repeat in engines if repeat == 1)


def test_children_never_use_nvlink_multicast(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    env = child_environment(device="cuda", nproc=2)
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == os.path.dirname(os.path.dirname(shardtrain.__file__))


def test_the_ideal_step_is_not_an_engine():
    with pytest.raises(ValueError, match="--ideal"):
        options(engines=("shardtrain", "ideal"))
