"""The training loop's step rule and EMA, on a 2-rank Gloo pool."""

from pathlib import Path

import pytest
import torch

from shardtrain.core.sharded_param import local_of
from shardtrain.engine import Engine
from shardtrain.train.config import load_config
from shardtrain.train.loop import _prepare, build_job, check_batch
from shardtrain.train.startup import StartupClock


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (root / f"m{i}.py").write_text(f"class C{i}:\n    value = {i}\n" * 30)
    return root


def _job(corpus: str, cache: str, *extra: str):
    engine = Engine(accelerator="cpu")
    engine.launch()
    cfg = load_config(
        None,
        [
            "--model.name",
            "llama-tiny",
            "--data.path",
            corpus,
            "--data.cache_dir",
            cache,
            "--data.seq_len",
            "32",
            "--run.progress",
            "false",
            "--optim.warmup_steps",
            "2",
            *extra,
        ],
    )
    return build_job(cfg, engine)[0]


def _accumulate(corpus: str, cache: str) -> dict:
    job = _job(corpus, cache, "--train.grad_accum", "3", "--train.batch_size", "12", "--train.steps", "4")
    read, optimizer_steps, samples = [], [], []
    batch = job.data.train.batch

    def recording(index):
        read.append(index)
        samples.extend(job.data.train.samples(index))
        return batch(index)

    job.data.train.batch = recording
    job.optimizer.register_step_post_hook(lambda *_: optimizer_steps.append(len(read)))
    lrs = []
    for step in range(4):
        job.train_step(step)
        lrs.append(job.scheduler.get_last_lr()[0])
    return {
        "read": read,
        "optimizer_steps": optimizer_steps,
        "scheduler_steps": job.scheduler.last_epoch,
        "lrs": lrs,
        "samples": samples,
    }


def test_one_scheduler_step_per_optimizer_step_and_disjoint_ranks(pools, corpus, tmp_path):
    r0, r1 = pools(2).run(_accumulate, str(corpus), str(tmp_path))
    for r in (r0, r1):
        assert r["read"] == list(range(12)), "3 micro-batches per step, in order"
        assert r["optimizer_steps"] == [3, 6, 9, 12], "the optimizer steps after every 3rd micro-batch"
        assert r["scheduler_steps"] == 4
    assert r0["lrs"] == r1["lrs"] and r0["lrs"][0] == pytest.approx(3e-3)  # warm-up of 2 reached at step 1
    assert sorted(r0["samples"] + r1["samples"]) == list(range(4 * 12)), "ranks split every global batch"


def _ema(corpus: str, cache: str) -> dict:
    job = _job(corpus, cache, "--train.ema_decay", "0.5", "--train.batch_size", "4", "--train.eval_batches", "1")
    rows = lambda: [local_of(p).detach().clone() for p in job.model.parameters()]  # noqa: E731 - this rank's rows
    before = rows()
    job.train_step(0)
    trained = rows()
    expected = [0.5 * b + 0.5 * t for b, t in zip(before, trained)]
    record = job.evaluate(1, 0.0)
    with job.ema.swapped_in():
        swapped = rows()
    restored = all(torch.equal(p, t) for p, t in zip(rows(), trained))
    return {
        "record": record,
        "restored": restored,
        "ema_ok": all(torch.allclose(s, e) for s, e in zip(swapped, expected)),
    }


def test_ema_is_evaluated_and_the_trained_weights_come_back(pools, corpus, tmp_path):
    for r in pools(2).run(_ema, str(corpus), str(tmp_path)):
        assert r["ema_ok"] and r["restored"]
        assert r["record"]["eval_loss_ema"] != r["record"]["eval_loss"]


def test_batch_rule_names_the_fix():
    cfg = load_config(None, ["--train.batch_size", "10", "--train.grad_accum", "4"])
    with pytest.raises(ValueError, match="use --train.batch_size 8"):
        check_batch(cfg, 2)
    assert check_batch(load_config(None, ["--train.batch_size", "16", "--train.grad_accum", "2"]), 2) == 8


def _prepare_error(*overrides: str) -> str:
    engine = Engine(accelerator="cpu")
    engine.launch()
    try:
        _prepare(load_config(None, list(overrides)), engine, clock=StartupClock())
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--train.batch_size", "1"],
            "train.batch_size=1 must be a multiple of world size 2 x train.grad_accum 1 = 2; use --train.batch_size 2",
        ),
        (["--model.name", "llama-3t"], "model.name='llama-3t' does not build: unknown Llama size '3t'"),
        (["--model.name", "llama-tiny"], "data.seq_len=256 exceeds the model's maximum sequence length 128"),
        (["--data.path", "/no/such/corpus"], "data.path='/no/such/corpus' does not exist"),
        (["--run.resume", "/no/such/ckpt"], "run.resume='/no/such/ckpt' does not exist"),
        (
            ["--run.out_dir", __file__],
            f"run.out_dir={__file__!r}: {__file__!r} is an existing file, not a directory; "
            "pass a directory for the runs",
        ),
        (["--run.out_dir", f"{__file__}/runs"], f"run.out_dir='{__file__}/runs': {__file__!r} is an existing file"),
        (
            ["--model.name", "llama-tiny", "--model.kwargs.n_layers", "abc"],
            "model.name='llama-tiny' does not build: model.kwargs.n_layers='abc' must be a positive integer "
            "(LlamaConfig.n_layers); e.g. --model.kwargs.n_layers 4",
        ),
    ],
)
def test_user_errors_are_found_on_every_rank_before_any_communication(pools, overrides, message):
    for error in pools(2).run(_prepare_error, *overrides):
        assert error.startswith(message)
