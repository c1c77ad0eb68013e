"""A rank that stalls or fails is named by its peers: heartbeats and failure reports in the store."""

import re
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from shardtrain.engine import health
from tests.train.test_cli import ROOT, TINY, _on_one_file

TIMEOUT_S = 5


def _train(args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    run = subprocess.run(
        [sys.executable, "-m", "shardtrain", "train", *args], capture_output=True, text=True, timeout=180, cwd=ROOT
    )
    return run, time.time()


@pytest.mark.slow  # end to end in fresh processes; test_explain_names_the_failed_or_missing_rank and
# tests/core/test_shard.py's group timeouts cover its parts in the default tier
def test_a_stuck_rank_is_named_and_the_job_exits_soon_after_the_timeout(tmp_path):
    run, ended = _train(
        [
            *TINY,
            "--model.name",
            "tests.train.faulty:sleepy_llama",
            "--model.kwargs",
            "{at: 3, seconds: 300, rank: 1}",
            "--engine.timeout",
            str(TIMEOUT_S),
            "--train.steps",
            "10",
            "--train.eval_every",
            "0",
            "--train.eval_batches",
            "1",
            *_on_one_file(tmp_path),
        ]
    )
    assert run.returncode == 1, run.stderr
    expected = (
        r"shardtrain train: rank 0 stopped: rank 1 did not arrive at a collective within "
        rf"engine.timeout={TIMEOUT_S}s \(rank 1 last reported step 3 \(train\) [\d.]+ s ago\); it is stuck "
        r"outside the collectives or slow: raise --engine.timeout if it is only slow"
    )
    assert re.search(expected, run.stderr), run.stderr
    assert "Traceback" not in run.stderr
    stalled = float(re.search(r"faulty: rank 1 sleeps 300s from ([\d.]+)", run.stderr)[1])
    assert ended - stalled < TIMEOUT_S + 6, f"exited {ended - stalled:.1f}s after rank 1 stalled"


@pytest.mark.slow  # test_explain_names_the_failed_or_missing_rank covers the logic in the default tier
def test_the_peer_of_a_rank_that_failed_alone_names_it_in_one_line(tmp_path):
    (tmp_path / "tiny.txt").write_text("short\n")  # rank 0 finds it too short while rank 1 waits for the cache
    run, _ = _train(
        [
            *TINY,
            "--data.path",
            str(tmp_path / "tiny.txt"),
            "--data.cache_dir",
            str(tmp_path / "cache"),
            "--run.out_dir",
            str(tmp_path),
        ]
    )
    assert run.returncode == 1
    failure = "holds out no token; use more text or a larger --data.val_fraction"
    assert "shardtrain train: error on rank 0: data.val_fraction=0.003 of the 6 tokens" in run.stderr
    assert re.search(rf"shardtrain train: rank 1 stopped: rank 0 failed: data.val_fraction=.*{failure}", run.stderr)
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 3, run.stderr


# ------------------------------------------------------------------------------------ on a pool
def _clear(store, world: int) -> None:
    for prefix in (health._BEAT, health._FAILED, health._WAITING):
        for rank in range(world):
            store.delete_key(f"{prefix}{rank}")


def _explain_cases() -> dict:
    """Rank 0's view of: rank 1 reporting a failure, then rank 1 not arriving after a timeout."""
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    _clear(store, 2)
    dist.barrier()
    out = {}
    if rank == 1:
        health.report_failure("data.path='x' does not exist; pass a file\nsecond line")
    dist.barrier()
    if rank == 0:
        out["failed"] = health.explain(RuntimeError("Connection reset by peer"), timeout_s=5)
        out["unknown"] = health.explain(RuntimeError("CUDA error: an illegal memory access"), timeout_s=5)
    dist.barrier()
    _clear(store, 2)
    dist.barrier()
    health.heartbeat(7, "eval")
    dist.barrier()
    if rank == 0:  # rank 1 is "stuck": it does not report waiting
        out["stuck"] = health.explain(RuntimeError("Timed out waiting 5000ms for recv"), timeout_s=5)
        out["closed"] = health.explain(RuntimeError("Application timeout caused pair closure"), timeout_s=5)
        out["gone"] = health.explain(RuntimeError("Connection closed by peer [127.0.0.1]:4242"), timeout_s=5)
    dist.barrier()
    _clear(store, 2)
    dist.barrier()
    return out


def test_explain_names_the_failed_or_missing_rank(pools):
    out = pools(2).run(_explain_cases)[0]
    assert out["failed"] == out["unknown"] == "rank 1 failed: data.path='x' does not exist; pass a file"
    assert re.fullmatch(
        r"rank 1 did not arrive at a collective within engine.timeout=5s \(rank 1 last reported step 7 "
        r"\(eval\) [\d.]+ s ago\); it is stuck outside the collectives or slow: raise --engine.timeout "
        r"if it is only slow",
        out["stuck"],
    ), out["stuck"]
    assert out["closed"].startswith("rank 1 did not arrive at a collective within engine.timeout=5s"), out["closed"]
    assert out["gone"] == (
        "a peer rank exited without reporting an error (killed, out of memory, or a crash outside "
        "Python): Connection closed by peer [127.0.0.1]:4242"
    )


def test_without_a_process_group_there_is_nothing_to_explain():
    if dist.is_initialized():
        pytest.skip("this test process holds a process group")
    health.heartbeat(1, "train")  # no-ops
    health.report_failure("x")
    assert health.explain(RuntimeError("Timed out"), timeout_s=1) is None
