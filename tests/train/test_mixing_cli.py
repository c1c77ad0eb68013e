"""`shardtrain train` on two weighted sources (data.sources): the summary's per-source shares, `--data.show`'s
source headers, and `--resume` mid-run training on the batches the uninterrupted run trained on."""

import json
from pathlib import Path

import pytest

from tests.data.tokenizers_fixture import train_tokenizer
from tests.train.facts import prompt_completion_rows, write_jsonl
from tests.train.test_cli import _train_on

pytest.importorskip("datasets")


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _args(tmp_path: Path) -> list[str]:
    task = write_jsonl(prompt_completion_rows(), tmp_path / "task.jsonl")
    chat = write_jsonl(
        [{"text": f"note {i}: the weather is mild and the tea is warm"} for i in range(150)], tmp_path / "general.jsonl"
    )
    texts = [r["prompt"] + r["completion"] for r in prompt_completion_rows()] + [
        "the weather is mild and the tea is warm"
    ]
    tokenizer = tmp_path / "tokenizer"
    train_tokenizer(texts, vocab_size=300).save_pretrained(tokenizer)
    return [
        "--model.name", "llama-tiny", "--model.kwargs.vocab_size", "320",
        "--data.tokenizer", str(tokenizer),
        "--data.sources", f"[{{path: {task}, weight: 0.7, val_fraction: 0.1}}, {{path: {chat}, weight: 1}}]",
        "--data.sources.1.weight", "0.3",
        "--data.train_on", "all",
        "--data.seq_len", "32", "--train.batch_size", "8", "--train.steps", "6", "--train.log_every", "1",
        "--train.eval_every", "3", "--run.checkpoint_every", "3", "--run.progress", "false",
        "--data.cache_dir", str(tmp_path / "cache"), "--run.out_dir", str(tmp_path),
    ]  # fmt: skip


def test_two_weighted_sources_report_their_shares_and_resume_on_the_same_batches(pools, tmp_path):
    common = _args(tmp_path)
    out = _train_on(pools(2), [*common, "--run.name", "whole", "--data.show", "1"])
    task, general = str(tmp_path / "task.jsonl"), str(tmp_path / "general.jsonl")
    assert f"=== source {task} ===" in out and f"=== source {general} ===" in out
    table = " ".join(out.replace("│", " ").split())  # the summary's cells, unwrapped
    assert "70.0% of the trained tokens" in table and "30.0% of the trained tokens" in table
    assert table.count("this run; ") == 2 and "(14 held out)" in table and "(0 held out)" in table
    whole = _records(tmp_path / "whole")
    assert [r["step"] for r in whole if r["kind"] == "eval"] == [0, 3, 6]  # the task's held-out rows

    _train_on(pools(2), [*common, "--run.name", "resumed", "--resume", str(tmp_path / "whole/checkpoints/step_000003")])
    keys = ("step", "loss", "grad_norm", "eval_loss")
    replay = [{k: r.get(k) for k in keys} for r in _records(tmp_path / "resumed") if r["kind"] != "summary"]
    original = [
        {k: r.get(k) for k in keys}
        for r in whole
        if (r["kind"] == "train" and r["step"] > 3) or (r["kind"] == "eval" and r["step"] >= 3)
    ]
    assert replay == original
