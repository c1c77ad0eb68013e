"""What the CLI tests of tokenized data share: a tiny model's arguments over a tokenizer trained on the facts,
the run's metrics records, and the records a run resumed mid-way must repeat."""

from __future__ import annotations

import json
from pathlib import Path

from tests.data.tokenizers_fixture import train_tokenizer
from tests.train.facts import prompt_completion_rows

REPLAYED = ("step", "loss", "grad_norm", "eval_loss")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tiny_args(tmp_path: Path, *, steps: int, every: int, extra_texts: tuple[str, ...] = ()) -> list[str]:
    """llama-tiny over a BPE tokenizer trained on the facts' rows (and `extra_texts`): 32-token windows,
    batches of 8, `steps` steps, evaluating and saving every `every`, logging every step; no data path."""
    tokenizer = tmp_path / "tokenizer"
    texts = [r["prompt"] + r["completion"] for r in prompt_completion_rows()] + list(extra_texts)
    train_tokenizer(texts, vocab_size=300).save_pretrained(tokenizer)
    return [
        "--model.name", "llama-tiny", "--model.kwargs.vocab_size", "320", "--data.tokenizer", str(tokenizer),
        "--data.seq_len", "32", "--train.batch_size", "8", "--train.steps", str(steps), "--train.log_every", "1",
        "--train.eval_every", str(every), "--run.checkpoint_every", str(every), "--run.progress", "false",
        "--data.cache_dir", str(tmp_path / "cache"), "--run.out_dir", str(tmp_path),
    ]  # fmt: skip


def replayed(whole: list[dict], resumed: list[dict], *, cut: int, keys: tuple[str, ...] = REPLAYED) -> tuple:
    """(what the run resumed at step `cut` logged, what the uninterrupted run logged from there), in `keys`."""
    replay = [{k: r.get(k) for k in keys} for r in resumed if r["kind"] not in ("summary", "startup")]
    original = [
        {k: r.get(k) for k in keys}
        for r in whole
        if (r["kind"] == "train" and r["step"] > cut) or (r["kind"] == "eval" and r["step"] >= cut)
    ]
    return replay, original
