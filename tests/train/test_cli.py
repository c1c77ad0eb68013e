"""`shardtrain` command line: dispatcher, config errors, and short end-to-end `shardtrain train` runs."""

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardtrain import cli
from shardtrain.train.schedule import warmup_cosine

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.name", "llama-tiny", "--data.seq_len", "64", "--train.batch_size", "8", "--run.progress", "false"]


def _train(args: list[str], timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardtrain", "train", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_missing_subcommand_module_answers_instead_of_crashing(monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "nosuch", "a subcommand nobody wrote")
    assert cli.main(["nosuch", "--any", "args"]) == 2
    assert (
        "shardtrain nosuch: not available yet in this build (module shardtrain.cli.nosuch is missing)"
        in capsys.readouterr().err
    )


def test_config_error_is_one_line_with_the_fix(capsys):
    assert cli.main(["train", "--train.stpes", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "did you mean 'train.steps'" in err


def test_train_help_lists_every_key(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--train.steps" in out and "--model.kwargs" in out and "--resume" in out
    # A factory name runs code: --help says so, where model.name is described and up front.
    assert out.count("imports that module and") == 2 and "runs the function" in " ".join(out.split())


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train_here(args: list[str]) -> tuple[int, str, str]:
    """On a pool rank: `shardtrain train ARGS` through the command's own entry point, in a process and
    group that exist already (a fresh launch costs seconds of imports); its exit code, stdout and stderr.
    The Engine gives the rank as many threads as a launched rank gets; the pool's count comes back after."""
    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["train", *args])
    finally:
        torch.set_num_threads(threads)
    return code, out.getvalue(), err.getvalue()


def _train_on(pool, args: list[str]) -> str:
    """`_train_here` on every rank of `pool`; fails with the ranks' stderr unless every rank exits 0;
    rank 0's stdout (the run's summary table)."""
    results = pool.run(_train_here, args)
    assert [code for code, _, _ in results] == [0] * len(results), [err for _, _, err in results]
    return results[0][1]


def test_short_run_writes_metrics_plot_and_config_and_resumes_exactly(pools, tmp_path):
    common = [
        *TINY,
        "--train.steps",
        "6",
        "--train.grad_accum",
        "2",
        "--train.eval_every",
        "3",
        "--train.log_every",
        "1",
        "--optim.warmup_steps",
        "2",
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--train.ema_decay",
        "0.9",
        "--run.checkpoint_every",
        "3",
        "--run.out_dir",
        str(tmp_path),
    ]
    run = _train([*common, "--run.name", "e2e"])
    assert run.returncode == 0, run.stderr
    assert "held-out loss" in run.stdout and "2 x cpu, full_shard" in run.stdout
    run_dir = tmp_path / "e2e"
    assert (run_dir / "metrics.png").stat().st_size > 10_000
    assert "name: llama-tiny" in (run_dir / "config.yaml").read_text()
    records = _records(run_dir)
    evals = [r for r in records if r["kind"] == "eval"]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert all(len(r["memory_bytes"]) == 2 and min(r["memory_bytes"]) > 0 for r in train)
    # One scheduler step per optimizer step, whatever grad_accum is: the lr logged after step s is the
    # schedule at s (0-based) for the next step.
    for r in train:
        assert r["lr"] == pytest.approx(3e-3 * warmup_cosine(r["step"], warmup_steps=2, total_steps=6, min_ratio=0.1))
    assert records[-1]["kind"] == "summary" and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert "eval_loss_ema" in evals[-1]
    (startup,) = [r for r in records if r["kind"] == "startup"]  # where the time to the first step went
    phases = {k: v for k, v in startup.items() if k.endswith("_s") and k != "total_s"}
    assert startup["step"] == 1 and {"launch_s", "model_s", "data_s", "shard_s", "first_step_s"} <= set(phases)
    assert startup["launch_s"] > 1 and min(phases.values()) >= 0  # a process that imported torch ran > 1 s
    assert startup["total_s"] == pytest.approx(sum(phases.values()), abs=0.01)

    # Resuming from step 3 (model, optimizer, scheduler, EMA, data position, RNG) replays steps 4-6 exactly,
    # in processes that ran other tests before (the launch itself is what the first run tests).
    _train_on(pools(2), [*common, "--run.name", "resumed", "--resume", str(run_dir / "checkpoints" / "step_000003")])
    keys = ("step", "loss", "lr", "grad_norm", "eval_loss", "eval_loss_ema")
    resumed = _records(tmp_path / "resumed")
    assert [r["resume_s"] > 0 for r in resumed if r["kind"] == "startup"] == [True]
    replay = [{k: r.get(k) for k in keys} for r in resumed if r["kind"] not in ("summary", "startup")]
    original = [
        r for r in records if (r["kind"] == "train" and r["step"] > 3) or (r["kind"] == "eval" and r["step"] >= 3)
    ]
    assert replay == [{k: r.get(k) for k in keys} for r in original]


def test_train_compile_reaches_the_engine():
    # Engine(compile=True) compiles the blocks after st.shard (tests/ops/test_compile_blocks.py)
    from shardtrain.cli.train import engine_options
    from shardtrain.train.config import load_config

    assert engine_options(load_config(None, ["--train.compile", "true"]))["compile"] is True
    assert engine_options(load_config(None, []))["compile"] is False


def _one_file(tmp_path: Path) -> Path:
    path = tmp_path / "one.txt"
    path.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(3000)))
    return path


def _on_one_file(tmp_path: Path) -> list[str]:
    """Arguments for a run on one small text file, with its cache and runs under `tmp_path`."""
    return [
        "--data.path",
        str(_one_file(tmp_path)),
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--run.out_dir",
        str(tmp_path),
    ]


@pytest.mark.slow  # the Engine-level test (tests/engine) covers the scheduler fix in the default tier
def test_fp16_with_the_scheduler_trains_on_a_single_file(pools, tmp_path):
    # On the pool through cli.main: the launch is what the other runs here test.
    out = _train_on(
        pools(2),
        [
            *TINY,
            "--engine.precision",
            "16-mixed",
            "--train.steps",
            "2",
            "--train.log_every",
            "1",
            "--train.eval_batches",
            "1",
            *_on_one_file(tmp_path),
            "--run.name",
            "fp16",
        ],
    )
    assert "2 x cpu, full_shard, 16-mixed" in out
    train = [r for r in _records(tmp_path / "fp16") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:  # the scheduler stepped once per optimizer step
        assert r["lr"] == pytest.approx(3e-3 * warmup_cosine(r["step"], warmup_steps=10, total_steps=2, min_ratio=0.1))


@pytest.mark.slow  # end to end in fresh processes; test_loop.py checks the same errors on every rank of a pool
def test_user_errors_are_reported_by_every_rank():
    run = _train(["--data.path", "/no/such/corpus"], timeout=60)
    assert run.returncode != 0
    for rank in (0, 1):
        assert f"shardtrain train: error on rank {rank}: data.path='/no/such/corpus' does not exist" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.slow  # the command on the pool (cli.main); tests/pretrained/ trains Hugging Face models there too
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (extra 'hf')")
def test_hugging_face_llama_from_config_trains(pools, tmp_path):
    hf = (
        "{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, vocab_size: 256, max_position_embeddings: 128}"
    )
    out = _train_on(
        pools(2),
        [
            "--model.name",
            "hf",
            "--model.kwargs",
            hf,
            "--data.seq_len",
            "64",
            "--train.batch_size",
            "8",
            "--train.steps",
            "12",
            "--train.eval_every",
            "0",
            "--optim.lr",
            "1e-2",
            "--data.cache_dir",
            str(tmp_path / "cache"),
            "--run.out_dir",
            str(tmp_path),
            "--run.name",
            "hf",
            "--run.progress",
            "false",
        ],
    )
    assert "LlamaForCausalLM" in out
    evals = [
        json.loads(line) for line in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines() if '"eval"' in line
    ]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.5
