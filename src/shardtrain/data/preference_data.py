"""Preference rows on disk -> cached token pairs -> batches of chosen and rejected sequences for one rank.

    load_rows -> check the columns -> PairEncoder (datasets.map, cached like the SFT path's tokens)
        -> hold out rows (data.eval_path, a seeded fraction, or none) -> PairBatches

A pair is never packed with another: each answer is one row of its own, the prompt's tokens followed by
the answer's, padded at its end to seq_len (causal attention never reads the padding, so nothing leaks
between the rows). A batch of this rank's n pairs holds 2n rows, the n chosen then the n rejected:

    input_ids     LongTensor[2n, T]
    labels        LongTensor[2n, T]   shifted (labels[r, t] is scored against logits[r, t]); -100 on the
                                      prompt and the padding: only the answer's tokens are scored
    pair          LongTensor[n]       the pair's number in its dataset (its cached reference log-probs);
                                      -1 for a padding pair of a partial held-out batch (scores nothing)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .batches import WindowOrder
from .pack import IGNORE
from .pipeline import DataSpec, _held_out_rows, cache_root
from .preference import PairEncoder, check_preference_columns
from .sources import load_rows
from .tokenizer import tokenizer_key

CACHE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class PreparedPairs:
    train: Any  # datasets.Dataset: prompt_ids, chosen_ids, rejected_ids, row
    held_out: Any  # the same of the held-out rows, or None
    key: str  # names the tokenized pairs in the cache (precomputed reference log-probs are stored beside)

    def describe(self) -> str:
        held = 0 if self.held_out is None else len(self.held_out)
        return f"{len(self.train):,} preference pairs ({held:,} held out)"


def _read(path: str, spec: DataSpec, *, key: str, cache_dir: str | None):
    if key == "data.path":  # the Hub coordinates belong to the training source only
        rows = load_rows(
            path,
            key=key,
            pattern=spec.pattern,
            cache_dir=cache_dir,
            config=spec.config,
            split=spec.split,
            revision=spec.revision,
        )
    else:
        rows = load_rows(path, key=key, pattern=spec.pattern, cache_dir=cache_dir)
    if spec.columns:
        rows = rows.rename_columns(dict(spec.columns))
    check_preference_columns(list(rows.column_names), where=f"{key}={path!r}")
    return rows


def read_pairs(spec: DataSpec, *, cache_dir: str | None = None) -> None:
    """Check that data.path (and data.eval_path) hold preference rows: cheap, for every rank before any collective."""
    _read(spec.path, spec, key="data.path", cache_dir=cache_dir)
    if spec.eval_path is not None:
        _read(spec.eval_path, spec, key="data.eval_path", cache_dir=cache_dir)


def prepare_pairs(spec: DataSpec, *, tokenizer, cache_dir: str | None = None) -> PreparedPairs:
    """Tokenize `spec`'s preference rows (or memory-map them from the cache) and hold some out."""
    root = cache_root(cache_dir) / "tokenized"
    root.mkdir(parents=True, exist_ok=True)
    encoder = PairEncoder(tokenizer=tokenizer, seq_len=spec.seq_len)

    def encode(rows, source: str):
        parts = [CACHE_VERSION, "pairs", source, rows._fingerprint, tokenizer_key(tokenizer), spec.seq_len]
        key = hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]
        pairs = rows.map(
            encoder,
            batched=True,
            with_indices=True,
            remove_columns=rows.column_names,
            new_fingerprint=key,
            cache_file_name=str(root / f"pairs-{key}.arrow"),
            desc="tokenizing pairs",
        )
        return pairs, key

    rows = _read(spec.path, spec, key="data.path", cache_dir=cache_dir)
    pairs, key = encode(rows, spec.path)
    if spec.eval_path is not None:
        held, _ = encode(_read(spec.eval_path, spec, key="data.eval_path", cache_dir=cache_dir), spec.eval_path)
        return PreparedPairs(train=pairs, held_out=held, key=key)
    held_rows = _held_out_rows(len(pairs), spec)
    if not len(held_rows):
        return PreparedPairs(train=pairs, held_out=None, key=key)
    kept = np.setdiff1d(np.arange(len(pairs)), held_rows)
    return PreparedPairs(train=pairs.select(kept), held_out=pairs.select(held_rows), key=f"{key}-{spec.seed}")


class PairBatches(WindowOrder):
    """Batches of preference pairs (module docstring), in the seeded order of WindowOrder."""

    all_trained = False

    def __init__(self, pairs, *, seq_len: int, pad_id: int, **order) -> None:
        super().__init__(len(pairs), holds=f"{len(pairs)} preference pairs", **order)
        self.pairs = pairs
        self.seq_len = seq_len
        self.pad_id = pad_id

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        picked = self.windows_of(index)
        n = self.per_rank
        ids = np.full((2 * n, self.seq_len), self.pad_id, dtype=np.int64)
        labels = np.full((2 * n, self.seq_len), IGNORE, dtype=np.int64)
        real = [b for b, w in enumerate(picked) if w is not None]
        rows = self.pairs[[picked[b] for b in real]]
        for b, prompt, chosen, rejected in zip(real, rows["prompt_ids"], rows["chosen_ids"], rows["rejected_ids"]):
            for r, answer in ((b, chosen), (n + b, rejected)):
                sequence = list(prompt) + list(answer)
                ids[r, : len(sequence)] = sequence
                # the token at t + 1 is scored against logits[t]: the answer's tokens only
                labels[r, len(prompt) - 1 : len(sequence) - 1] = answer
        return {
            "input_ids": torch.from_numpy(ids),
            "labels": torch.from_numpy(labels),
            "pair": torch.tensor([-1 if w is None else w for w in picked], dtype=torch.int64),
        }
