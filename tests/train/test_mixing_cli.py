"""`shardtrain train` on two weighted sources (data.sources): the summary's per-source shares, `--data.show`'s
source headers, and `--resume` mid-run training on the batches the uninterrupted run trained on."""

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
    task = write_jsonl(prompt_completion_rows(), tmp_path / "task.jsonl")
    chat = write_jsonl([{"text": f"note {i}: {GENERAL}"} for i in range(150)], tmp_path / "general.jsonl")
    return [
        *tiny_args(tmp_path, steps=6, every=3, extra_texts=(GENERAL,)),
        "--data.sources", f"[{{path: {task}, weight: 0.7, val_fraction: 0.1}}, {{path: {chat}, weight: 1}}]",
        "--data.sources.1.weight", "0.3",
        "--data.train_on", "all",
    ]  # fmt: skip


def test_two_weighted_sources_report_their_shares_and_resume_on_the_same_batches(pools, tmp_path):
    common = _args(tmp_path)
    out = _train_on(pools(2), [*common, "--run.name", "whole", "--data.show", "1"])
    task, general = str(tmp_path / "task.jsonl"), str(tmp_path / "general.jsonl")
    # --data.show: each source's share of the trained tokens, its rows and tokens, then its documents
    assert f"=== source {task} ===\n70.0% of the trained tokens (" in out
    assert re.search(f"=== source {re.escape(general)} ===\n30.0% of the trained tokens .*; 150 rows .* tokens", out)
    table = " ".join(out.replace("│", " ").split())  # the summary's cells, unwrapped
    assert "70.0% of the trained tokens" in table and "30.0% of the trained tokens" in table
    assert table.count("this run; ") == 2 and "(14 held out)" in table and "(0 held out)" in table
    whole = records(tmp_path / "whole")
    assert [r["step"] for r in whole if r["kind"] == "eval"] == [0, 3, 6]  # the task's held-out rows

    _train_on(pools(2), [*common, "--run.name", "resumed", "--resume", str(tmp_path / "whole/checkpoints/step_000003")])
    replay, original = replayed(whole, records(tmp_path / "resumed"), cut=3)
    assert replay == original and len(original) == 5


def test_the_whole_mix_holds_rows_out_through_data_eval_path(pools, tmp_path, capsys):
    task = write_jsonl(prompt_completion_rows()[:120], tmp_path / "task.jsonl")
    held = write_jsonl(prompt_completion_rows()[120:], tmp_path / "held.jsonl")
    chat = write_jsonl([{"text": f"note {i}: {GENERAL}"} for i in range(150)], tmp_path / "general.jsonl")
    args = [
        *tiny_args(tmp_path, steps=2, every=2, extra_texts=(GENERAL,)),
        "--data.sources", f"[{{path: {task}, weight: 0.5}}, {{path: {chat}, weight: 0.5, train_on: all}}]",
        "--data.eval_path", str(held), "--run.name", "mix",
    ]  # fmt: skip
    _train_on(pools(2), args)
    evals = [r for r in records(tmp_path / "mix") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2] and all("loss" not in r for r in evals)  # one loss: the mix's
    assert cli.main(["train", *args, "--data.sources.0.val_fraction", "0.1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "or per source (their eval_path, val_fraction), not both" in err
