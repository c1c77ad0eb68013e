"""`shardtrain bench` end to end on the CPU: two Gloo processes per engine, fresh torchrun each."""

import json

import pytest

from shardtrain.cli import main


@pytest.mark.slow
def test_cpu_bench_shardtrain_and_fsdp2(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--sizes",
            "tiny",
            "--seq",
            "64",
            "--batch",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--nproc",
            "2",
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--engines",
            "shardtrain,fsdp2,fsdp2-split,shardtrain-auto",
            "--json",
            str(out),
            "--timeout",
            "240",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = {row["engine"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"shardtrain", "fsdp2", "fsdp2-split", "shardtrain-auto"}
    for row in rows.values():
        assert row["status"] == "ok" and row["nproc"] == 2 and row["runs"] == 1
        assert row["tokens_per_s_gpu"]["median"] > 0 and row["tokens_per_s_all"] > 0
        assert row["rss_gib"] > 0 and row["loss_step"] == 3
    # Same weights, same data, fp32 throughout: the engines differ only in reduction order.
    assert rows["shardtrain"]["losses"] == pytest.approx(rows["fsdp2"]["losses"], rel=1e-5)
    assert rows["shardtrain-auto"]["losses"] == pytest.approx(rows["fsdp2"]["losses"], rel=1e-5)
    assert rows["fsdp2-split"]["losses"] == pytest.approx(rows["fsdp2"]["losses"], rel=1e-5)
    assert rows["fsdp2-split"]["label"] == "torch FSDP2 (embedding, head apart)"
    # The auto row names what the planner chose for this micro-batch.
    assert rows["shardtrain-auto"]["label"].startswith("shardtrain auto (")
    assert "ckpt" in rows["shardtrain-auto"]["label"]
    assert rows["fsdp2"]["vs_baseline"] == 1.0
    assert "shardtrain (full_shard)" in printed and "torch FSDP2" in printed and "loss@3" in printed


def test_bench_rejects_unknown_engine_before_launching(capsys):
    assert main(["bench", "--device", "cpu", "--sizes", "tiny", "--engines", "shardtrain,deepspeed"]) == 2
    assert "unknown engine 'deepspeed'" in capsys.readouterr().err
