"""Aggregation of run records into rows, and the printed tables."""

import json

from shardtrain.bench.registry import resolve_engine
from shardtrain.bench.report import breakdown_table, render, results_table
from shardtrain.bench.results import RunRecord, aggregate
from shardtrain.bench.runner import read_outcome
from shardtrain.bench.spec import RunSpec


def run_spec(engine, device="cuda"):
    return RunSpec(
        engine=engine,
        size="1.5b",
        batch=2,
        seq=4096,
        ac=False,
        steps=3,
        warmup=1,
        device=device,
        precision="bf16",
        shard_world=2,
    )


def record(engine, step_ms, loss, *, device="cuda", breakdown=None, nproc=2):
    result = {
        "label": resolve_engine(engine).label,
        "world": nproc,
        "step_ms": step_ms,
        "losses": [11.9, loss],
        "memory_gib": {"allocated": 33.14, "reserved": 36.0, "rss": 3.0}
        if device == "cuda"
        else {"allocated": None, "reserved": None, "rss": 0.51},
        "breakdown": breakdown,
        "trace": None,
    }
    return RunRecord(spec=run_spec(engine, device), nproc=nproc, repeat=0, status="ok", wall_s=10.0, result=result)


BREAKDOWN = {
    "steps": 2,
    "step_ms": 200.0,
    "compute_ms": 150.0,
    "exposed_comm_ms": 30.0,
    "exposed_copy_ms": 10.0,
    "idle_ms": 10.0,
    "comm_ms": 120.0,
    "collectives": 57.0,
    "beside_comm_ms": 42.5,
    "gaps": [
        {"at_ms": 0.0, "ms": 2.25, "during": ["nccl AllGather", "bfloat16_copy_kernel_cuda"]},
        {"at_ms": 199.0, "ms": 0.5, "during": []},
    ],
}


def rows():
    records = [
        record("shardtrain", [160.0, 170.0, 180.0], 11.7512, breakdown=BREAKDOWN),
        record("fsdp2", [190.0, 200.0, 210.0], 11.7513),
        RunRecord(
            spec=run_spec("ddp"),
            nproc=2,
            repeat=0,
            status="out of memory",
            wall_s=5.0,
            error="OutOfMemoryError: CUDA out of memory",
        ),
        record("ideal", [150.0, 150.0, 150.0], 11.8, nproc=1),
    ]
    return aggregate(records, peak_tflops=790.0)


def test_rows_pool_steps_and_compare_with_fsdp2_and_the_ideal():
    shardtrain, fsdp2, ddp, ideal = rows()
    assert shardtrain.tokens_per_s_gpu.median == 8192 * 1000 / 170
    assert shardtrain.tokens_per_s_gpu.min == 8192 * 1000 / 180
    assert shardtrain.tokens_per_s_all == 2 * 8192 * 1000 / 170
    assert shardtrain.vs_baseline == 200 / 170 and fsdp2.vs_baseline == 1.0
    assert shardtrain.over_ideal == 170 / 150
    assert shardtrain.loss == 11.7512 and shardtrain.loss_step == 2
    assert ddp.status == "out of memory" and ddp.tokens_per_s_gpu is None
    assert ideal.over_ideal == 1.0


def test_results_table_layout():
    lines = results_table(rows()).splitlines()
    assert lines[0].split() == [
        "size",
        "engine",
        "tok/s/GPU",
        "min",
        "max",
        "tok/s",
        "all",
        "MFU",
        "alloc",
        "GiB",
        "reserved",
        "GiB",
        "vs",
        "FSDP2",
        "step/ideal",
        "loss@2",
    ]
    assert set(lines[1]) <= {"-", " "}
    assert len({len(line) for line in lines[:3]}) == 1  # padded columns
    shardtrain = lines[2]
    assert shardtrain.startswith("1.5b  shardtrain (full_shard)")
    assert "48,188" in shardtrain and "1.176" in shardtrain and "1.13" in shardtrain and "11.7512" in shardtrain
    assert "33.1" in shardtrain and "36.0" in shardtrain
    mfu = 100 * 8_421_519_360 * (8192 * 1000 / 170) / 790e12
    assert f"{mfu:.1f}%" in shardtrain
    ddp = lines[4]
    assert "DDP" in ddp and "out of memory" in ddp and "11." not in ddp
    assert lines[5].rstrip().endswith("—")  # the ideal step has no comparable loss


def test_cpu_table_shows_resident_memory():
    table = results_table(aggregate([record("fsdp2", [100.0], 5.0, device="cpu")], peak_tflops=None))
    assert "peak RSS GiB" in table and "alloc GiB" not in table and "0.5" in table
    assert "tok/s/rank" in table and "tok/s/GPU" not in table


def test_breakdown_table_and_render():
    table = breakdown_table(rows())
    assert "150.0 (75%)" in table and "30.0 (15%)" in table and "120.0" in table
    assert "NCCL kernels" in table and table.splitlines()[-1].split()[-2:] == ["57", "42.5"]
    text = render(rows())
    assert "MFU = (6·(params − embedding)" in text and "790 TFLOP/s" in text
    assert "CUDA out of memory" in text
    assert "Longest compute-stream gaps" in text
    gap_lines = [line.split() for line in text.splitlines() if "nccl AllGather" in line or "waiting for" in line]
    assert gap_lines[0][3:6] == ["0.0", "2.25", "nccl"] and gap_lines[1][3:6] == ["199.0", "0.50", "nothing"]


def test_read_outcome_prefers_a_result_then_out_of_memory(tmp_path):
    out = tmp_path / "run.json"
    log = tmp_path / "run.log"
    log.write_text("line 1\nTraceback: boom\n")
    base = RunRecord(spec=run_spec("fsdp2"), nproc=2, repeat=0, status="ok", wall_s=1.0)
    failed = read_outcome(base, out=str(out), rc=1, log_path=str(log), timeout_s=60)
    assert failed.status == "failed" and "boom" in failed.error
    log.write_text("NCCL watchdog: CUDA error: out of memory\n")
    assert read_outcome(base, out=str(out), rc=-6, log_path=str(log), timeout_s=60).status == "out of memory"
    assert read_outcome(base, out=str(out), rc=None, log_path=str(log), timeout_s=60).status == "timed out"
    (tmp_path / "run.json.rank1.json").write_text(json.dumps({"status": "failed", "error": "peer"}))
    (tmp_path / "run.json.rank0.json").write_text(json.dumps({"status": "out of memory", "error": "OOM"}))
    assert read_outcome(base, out=str(out), rc=1, log_path=str(log), timeout_s=60).error == "OOM"
    out.write_text(json.dumps({"step_ms": [1.0]}))
    assert read_outcome(base, out=str(out), rc=1, log_path=str(log), timeout_s=60).result == {"step_ms": [1.0]}
