"""`shardtrain train --data.streaming true` on two ranks: trains and evaluates on data.eval_path, measures
data_load_s, and `--resume` mid-run trains on the batches the uninterrupted run trained on; the one-line refusals."""

import json
from pathlib import Path

import pytest

from shardtrain import cli
from tests.data.tokenizers_fixture import train_tokenizer
from tests.train.facts import prompt_completion_rows, write_jsonl
from tests.train.test_cli import _train_on

pytest.importorskip("datasets")


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _args(tmp_path: Path) -> list[str]:
    rows = prompt_completion_rows()
    train = write_jsonl(rows[:120], tmp_path / "train.jsonl")
    held = write_jsonl(rows[120:], tmp_path / "held.jsonl")
    tokenizer = tmp_path / "tokenizer"
    train_tokenizer([r["prompt"] + r["completion"] for r in rows], vocab_size=300).save_pretrained(tokenizer)
    return [
        "--model.name", "llama-tiny", "--model.kwargs.vocab_size", "320",
        "--data.tokenizer", str(tokenizer), "--data.path", str(train), "--data.eval_path", str(held),
        "--data.streaming", "true", "--data.stream_buffer", "16",
        "--data.seq_len", "32", "--train.batch_size", "8", "--train.steps", "8", "--train.log_every", "1",
        "--train.eval_every", "4", "--run.checkpoint_every", "4", "--run.progress", "false",
        "--data.cache_dir", str(tmp_path / "cache"), "--run.out_dir", str(tmp_path),
    ]  # fmt: skip


def test_streamed_training_resumes_on_the_same_batches(pools, tmp_path):
    common = _args(tmp_path)
    _train_on(pools(2), [*common, "--run.name", "whole"])
    whole = _records(tmp_path / "whole")
    assert [r["step"] for r in whole if r["kind"] == "eval"] == [0, 4, 8]
    assert all(r["data_load_s"] >= 0 for r in whole if r["kind"] == "train")
    # only the held-out file was tokenized into the cache: the training rows streamed
    assert len(list((tmp_path / "cache" / "tokenized").glob("docs-*.arrow"))) == 1

    _train_on(pools(2), [*common, "--run.name", "resumed", "--resume", str(tmp_path / "whole/checkpoints/step_000004")])
    keys = ("step", "loss", "grad_norm", "eval_loss")
    replay = [{k: r.get(k) for k in keys} for r in _records(tmp_path / "resumed") if r["kind"] != "summary"]
    original = [
        {k: r.get(k) for k in keys}
        for r in whole
        if (r["kind"] == "train" and r["step"] > 4) or (r["kind"] == "eval" and r["step"] >= 4)
    ]
    assert replay == original and len(original) == 6


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--train.epochs", "1"], "train.epochs=1.0 is invalid: streamed data is never counted"),
        (["--data.val_fraction", "0.1"], "data.val_fraction=0.1 is invalid: streamed rows are never counted"),
        (["--data.sources", "[{path: a}, {path: b}]"], "data.streaming=True is invalid: streaming reads one source"),
    ],
)
def test_what_streaming_cannot_do_is_refused_in_one_line(capsys, args, error):
    assert cli.main(["train", "--data.streaming", "true", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and error in err
