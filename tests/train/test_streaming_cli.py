"""`shardtrain train --data.streaming true` on two ranks: one source trains and evaluates on data.eval_path,
measures data_load_s and `--resume`s mid-run on the batches the uninterrupted run trained on; two sources
mixed by weight do the same, each evaluated on its own; the one-line refusals."""

import re
from pathlib import Path

import pytest

from shardtrain import cli
from tests.train.data_runs import records, replayed, tiny_args
from tests.train.facts import prompt_completion_rows, write_jsonl
from tests.train.test_cli import _train_on

pytest.importorskip("datasets")
GENERAL = "the weather is mild and the tea is warm"


def _args(tmp_path: Path) -> list[str]:
    rows = prompt_completion_rows()
    train = write_jsonl(rows[:120], tmp_path / "train.jsonl")
    held = write_jsonl(rows[120:], tmp_path / "held.jsonl")
    return [
        *tiny_args(tmp_path, steps=8, every=4),
        "--data.path", str(train), "--data.eval_path", str(held),
        "--data.streaming", "true", "--data.stream_buffer", "16",
    ]  # fmt: skip


def _resumes_exactly(pool, common: list[str], tmp_path: Path) -> list[dict]:
    """The uninterrupted run's records, after checking that a run resumed at step 4 repeats them."""
    _train_on(pool, [*common, "--run.name", "resumed", "--resume", str(tmp_path / "whole/checkpoints/step_000004")])
    whole = records(tmp_path / "whole")
    replay, original = replayed(whole, records(tmp_path / "resumed"), cut=4)
    assert replay == original and len(original) == 6
    return whole


def test_streamed_training_resumes_on_the_same_batches(pools, tmp_path):
    common = _args(tmp_path)
    _train_on(pools(2), [*common, "--run.name", "whole"])
    whole = _resumes_exactly(pools(2), common, tmp_path)
    assert [r["step"] for r in whole if r["kind"] == "eval"] == [0, 4, 8]
    assert all(r["data_load_s"] >= 0 for r in whole if r["kind"] == "train")
    # only the held-out file was tokenized into the cache: the training rows streamed
    assert len(list((tmp_path / "cache" / "tokenized").glob("docs-*.arrow"))) == 1


def test_two_streamed_sources_mix_by_weight_evaluate_each_and_resume_on_the_same_batches(pools, tmp_path):
    rows = prompt_completion_rows()
    general = [{"text": f"note {i}: {GENERAL}"} for i in range(160)]
    paths = {
        name: write_jsonl(part, tmp_path / f"{name}.jsonl")
        for name, part in (("task", rows[:120]), ("task_held", rows[120:]), ("chat", general[:140]))
    }
    chat_held = write_jsonl(general[140:], tmp_path / "chat_held.jsonl")
    sources = (
        f"[{{path: {paths['task']}, weight: 0.7, eval_path: {paths['task_held']}}}, "
        f"{{path: {paths['chat']}, weight: 0.3, eval_path: {chat_held}, train_on: all, name: general}}]"
    )
    common = [
        *tiny_args(tmp_path, steps=8, every=4, extra_texts=(GENERAL,)),
        "--data.sources", sources, "--data.streaming", "true", "--data.stream_buffer", "16",
    ]  # fmt: skip
    out = _train_on(pools(2), [*common, "--run.name", "whole", "--data.show", "1"])
    assert f"=== source data.path='{paths['chat']}' ===\n30.0% of the trained tokens aimed" in out
    table = " ".join(out.replace("│", " ").split())
    shares = [float(x) for x in re.findall(r"aimed, ([\d.]+)% this run; [\d,]+ rows streamed", table)]
    assert len(shares) == 2 and abs(shares[0] - 70) <= 5 and abs(sum(shares) - 100) < 0.2, table
    whole = _resumes_exactly(pools(2), common, tmp_path)
    evals = [r for r in whole if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 4, 8] and all(set(r["loss"]) == {"task", "general"} for r in evals)
    losses = [r["loss"] for r in evals]
    assert losses[-1]["task"] < losses[0]["task"] and losses[-1]["general"] < losses[0]["general"]
    assert min(losses[0].values()) <= evals[0]["eval_loss"] <= max(losses[0].values())  # the tokens' mean


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--train.epochs", "1"], "train.epochs=1.0 is invalid: streamed data is never counted"),
        (["--data.val_fraction", "0.1"], "data.val_fraction=0.1 is invalid: streamed rows are never counted"),
        (
            ["--data.sources", "[{path: a, weight: 1}, {path: b}]"],
            "data.sources.1.weight=None is invalid: streamed sources are never counted, so they mix by weight only",
        ),
        (
            ["--data.sources", "[{path: a, val_fraction: 0.1}]"],
            "data.sources.0.val_fraction=0.1 is invalid: streamed rows are never counted",
        ),
    ],
)
def test_what_streaming_cannot_do_is_refused_in_one_line(capsys, args, error):
    assert cli.main(["train", "--data.streaming", "true", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and error in err
