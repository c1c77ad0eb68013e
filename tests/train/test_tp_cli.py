"""`shardtrain train --engine.tp N`: tensor parallelism from the command line, and what it refuses."""

import pytest

from shardtrain import cli

from .test_cli import TINY, _on_one_file, _records, _train, _train_on


@pytest.mark.slow  # a 2-rank training in fresh processes and one on the pool; tests/tp checks the core's parity
def test_tp_2_trains_the_losses_of_tp_1(pools, tmp_path):
    steps = "--train.steps 3 --train.log_every 1 --train.eval_every 0 --train.eval_batches 1".split()
    common = [*TINY, *steps, *_on_one_file(tmp_path)]
    # tp 1: two data-parallel ranks of 4 rows (the reference: on the pool, through the same entry point);
    # tp 2 (sequence and loss parallel), launched: one tp group reading all 8 rows
    _train_on(pools(2), [*common, "--run.name", "dp"])
    parallel = ["--engine.sequence_parallel", "true", "--engine.loss_parallel", "true"]
    split = _train([*common, "--run.name", "tp", "--engine.tp", "2", *parallel])
    assert split.returncode == 0, split.stderr
    assert "2 x cpu, full_shard, 32-true, tp 2" in split.stdout
    want, got = ([r for r in _records(tmp_path / name) if r["kind"] in ("train", "eval")] for name in ("dp", "tp"))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3, 3]
    for a, b in zip(want, got):
        for key in {"loss", "grad_norm", "eval_loss"} & set(a):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--engine.devices", "3"], "Engine(tp=2) with 3 processes: the world must be a multiple of tp"),
        (["--engine.cpu_offload", "true"], "Engine(tp=2) with cpu_offload=True: offload is not supported"),
        (["--engine.strategy", "auto"], "engine.tp=2: the automatic plan does not plan tensor parallelism"),
        (["--engine.strategy", "hybrid_shard"], "use 'full_shard' or 'shard_grad_op'"),
    ],
)
def test_tp_refusals_are_one_line_with_the_fix(capsys, args, message):
    assert cli.main(["train", "--engine.tp", "2", "--engine.accelerator", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err


def test_sequence_and_loss_parallel_need_tp(capsys):
    assert cli.main(["train", "--engine.sequence_parallel", "true"]) == 2
    assert "also give --engine.tp N" in capsys.readouterr().err
    assert cli.main(["train", "--engine.loss_parallel", "true"]) == 2
    assert "loss parallelism splits the logits over the tp ranks: also give --engine.tp N" in capsys.readouterr().err
