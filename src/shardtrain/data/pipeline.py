"""Rows on disk -> packed training and held-out windows, built once, in parallel, and cached.

    load_rows (datasets) -> detect_format -> Encoder (datasets.map, num_proc workers)
        -> hold out rows (data.eval_path, a seeded fraction of the rows, or none) -> windows (pack.py)

Each stage is a `datasets.map` whose result is an Arrow file under the cache folder, named by a key
of everything that changes it (the source: its path or Hub id, config, split and revision, and its
data's fingerprint; the tokenizer and its chat template, seq_len, packing, the loss mask and the
held-out split), so a second run with the same inputs memory-maps
the windows instead of tokenizing again, and a dataset larger than memory streams from disk.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .deps import require
from .encode import Encoder, Overlong, TrainOn
from .formats import Format, detect_format
from .pack import windows
from .prompts import held_out_prompts
from .sources import load_rows
from .tokenizer import tokenizer_key

CACHE_VERSION = 1
PACK_GROUP = 1000  # documents per packing batch: best-fit within it


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """What to read and how to turn it into windows (the data section of a run, or an API call's arguments)."""

    path: str  # a local file or folder, or a Hub dataset id (org/name)
    seq_len: int
    config: str | None = None  # of a Hub dataset (its README's configs); None: its default
    split: str = "train"
    revision: str | None = None  # of a Hub dataset id: a branch, tag or commit; None: main
    eval_path: str | None = None
    format: str = "auto"
    columns: tuple[tuple[str, str], ...] = ()  # (old, new) column renames, applied before the format is detected
    train_on: str = "completion"
    packing: bool = True
    overlong: str = "truncate"
    val_fraction: float = 0.0  # of the rows, held out when no eval_path; 0: every row trains
    seed: int = 0
    pattern: str = "**/*"


@dataclass(frozen=True, kw_only=True)
class DataStats:
    """What the windows hold, for the run summary."""

    rows: int
    held_out_rows: int
    documents: int
    tokens: int  # real (not padding) tokens in the training windows
    supervised_tokens: int  # tokens the loss is taken on
    truncated_rows: int
    dropped_rows: int
    windows: int
    seq_len: int

    @property
    def packing_efficiency(self) -> float:
        """Real tokens over the windows' capacity (windows x seq_len)."""
        return self.tokens / max(1, self.windows * self.seq_len)

    def describe(self) -> str:
        return (
            f"{self.rows:,} rows ({self.held_out_rows:,} held out), {self.supervised_tokens:,} of {self.tokens:,} "
            f"tokens trained, {self.truncated_rows:,} truncated, {self.dropped_rows:,} dropped, {self.windows:,} "
            f"windows of {self.seq_len} ({self.packing_efficiency:.1%} full)"
        )


@dataclass(frozen=True, kw_only=True)
class Prepared:
    train: Any  # datasets.Dataset of windows: input_ids, labels, position_ids
    held_out: Any  # the same of the held-out rows; None when none is held out (val_fraction 0, no eval_path)
    format: Format
    stats: DataStats
    prompts: list[dict]  # held-out prompts for samples: {"prompt_ids": [...], "reference": str}


def cache_root(cache_dir: str | None) -> Path:
    """Where tokenized data is cached: `cache_dir` (data.cache_dir), else $XDG_CACHE_HOME/shardtrain
    (~/.cache/shardtrain)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardtrain"


def prepare(
    spec: DataSpec,
    *,
    tokenizer,
    cache_dir: str | None = None,
    num_proc: int = 0,
    progress: bool = True,
    prompts: int = 0,
) -> Prepared:
    """Tokenize, mask, hold out and pack `spec`'s rows (or memory-map them from the cache); ValueError with the fix."""
    rows, fmt = read_source(spec, tokenizer=tokenizer, cache_dir=cache_dir, progress=progress)
    where = f"data.path={spec.path!r}"
    workers = num_proc or min(os.cpu_count() or 1, len(rows) // 2000) or 1
    if workers > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are the parallelism
    root = cache_root(cache_dir)
    (root / "tokenized").mkdir(parents=True, exist_ok=True)
    encoder = encoder_of(spec, fmt, tokenizer=tokenizer)
    tok_key = tokenizer_key(tokenizer)
    common: dict[str, Any] = dict(root=root, workers=workers, tok_key=tok_key, spec=spec)
    docs = _encode(rows, encoder, **common)
    if spec.eval_path is not None:
        eval_rows = _renamed(
            load_rows(spec.eval_path, key="data.eval_path", pattern=spec.pattern, cache_dir=cache_dir),
            spec,
            where=f"data.eval_path={spec.eval_path!r}",
        )
        train_docs, held_docs = docs, _encode(eval_rows, encoder, **common)
    else:
        held = _held_out_rows(len(rows), spec)
        eval_rows = rows.select(held)
        doc_rows = np.asarray(docs.with_format("numpy")["row"])
        is_held = np.isin(doc_rows, held)
        train_docs, held_docs = docs.select(np.flatnonzero(~is_held)), docs.select(np.flatnonzero(is_held))
    _check_trained(train_docs, where=where, seq_len=spec.seq_len)
    train = _pack(train_docs, "train", root=root, workers=workers, spec=spec)
    held_out = _pack(held_docs, "held", root=root, workers=workers, spec=spec) if len(held_docs) else None
    return Prepared(
        train=train,
        held_out=held_out,
        format=fmt,
        stats=_stats(train_docs, train, rows=len(rows), held_out_rows=len(eval_rows), seq_len=spec.seq_len),
        prompts=held_out_prompts(eval_rows, fmt, tokenizer, count=prompts) if prompts else [],
    )


def encoder_of(spec: DataSpec, fmt: Format, *, tokenizer) -> Encoder:
    """The encoder of `spec`'s rows of format `fmt`."""
    return Encoder(
        tokenizer=tokenizer,
        format=fmt,
        train_on=TrainOn(spec.train_on),
        seq_len=spec.seq_len,
        overlong=Overlong(spec.overlong),
    )


def read_source(
    spec: DataSpec, *, tokenizer, cache_dir: str | None = None, progress: bool = True, streaming: bool = False
) -> tuple[Any, Format]:
    """The rows of data.path and their format, with data.eval_path checked alike: every mistake in what
    the files hold (a missing path, unknown columns, chat rows without a template) is found here,
    cheaply enough for every rank to run it before any communication. `progress`: datasets' bars.
    `streaming`: the rows as a `datasets.IterableDataset`, read as they are iterated (data/stream.py)."""
    datasets = require("datasets", why=f"data.path={spec.path!r}")
    (datasets.enable_progress_bars if progress else datasets.disable_progress_bars)()
    rows = load_rows(
        spec.path,
        config=spec.config,
        split=spec.split,
        revision=spec.revision,
        pattern=spec.pattern,
        cache_dir=cache_dir,
        streaming=streaming,
    )
    where = f"data.path={spec.path!r}"
    rows = _renamed(rows, spec, where=where)
    columns = rows.column_names if rows.column_names is not None else list(next(iter(rows), {}))
    fmt = detect_format(columns, forced=spec.format, where=where)
    if fmt is Format.MESSAGES and not tokenizer.chat_template:
        raise ValueError(
            f"{where} holds chat messages but the tokenizer has no chat template; give it one "
            "(tokenizer_config.json's chat_template) or pass --data.tokenizer with a chat tokenizer"
        )
    if spec.eval_path is not None:
        eval_rows = _renamed(
            load_rows(spec.eval_path, key="data.eval_path", pattern=spec.pattern, cache_dir=cache_dir),
            spec,
            where=f"data.eval_path={spec.eval_path!r}",
        )
        eval_fmt = detect_format(eval_rows.column_names, forced=spec.format, where=f"data.eval_path={spec.eval_path!r}")
        if eval_fmt is not fmt:
            raise ValueError(
                f"data.eval_path={spec.eval_path!r} holds {eval_fmt.value} rows but data.path holds {fmt.value} "
                "rows; hold out rows of the same layout"
            )
    return rows, fmt


def _renamed(rows, spec: DataSpec, *, where: str):
    """`rows` with the source's column renames (columns = {old: new}) applied; a column it lacks is an error."""
    if not spec.columns:
        return rows
    missing = [old for old, _ in spec.columns if old not in rows.column_names]
    if missing:
        raise ValueError(
            f"{where}: columns renames {missing}, but the rows have {rows.column_names}; name existing columns"
        )
    return rows.rename_columns(dict(spec.columns))


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps([CACHE_VERSION, *parts], default=str).encode()).hexdigest()[:20]


def _encode(rows, encoder: Encoder, *, root: Path, workers: int, tok_key: str, spec: DataSpec):
    source = (spec.path, spec.config, spec.split, spec.revision)
    key = _key(
        "encode", source, rows._fingerprint, tok_key, encoder.format.value, spec.train_on, spec.seq_len, spec.overlong
    )
    return rows.map(
        encoder,
        batched=True,
        with_indices=True,
        remove_columns=rows.column_names,
        num_proc=workers if workers > 1 else None,
        new_fingerprint=key,
        cache_file_name=str(root / "tokenized" / f"docs-{key}.arrow"),
        desc="tokenizing",
    )


def _held_out_rows(n: int, spec: DataSpec) -> np.ndarray:
    """The held-out row numbers: a seeded choice of val_fraction of them (at least one, not all; none for 0)."""
    if spec.val_fraction == 0:
        return np.zeros(0, dtype=np.int64)
    held = max(1, round(n * spec.val_fraction))
    if held >= n:
        raise ValueError(
            f"data.path={spec.path!r} has {n} row(s): data.val_fraction={spec.val_fraction} leaves none to "
            "train on; use more rows, a smaller --data.val_fraction or --data.eval_path"
        )
    return np.sort(np.random.default_rng(spec.seed).permutation(n)[:held])


def _check_trained(docs, *, where: str, seq_len: int) -> None:
    """A kept document without one trained token is an error naming its row (never a silent skip)."""
    table = docs.with_format("numpy")
    kept = np.asarray(table["kept"], dtype=bool)
    trained = np.asarray(table["n_trained"])
    empty = np.flatnonzero(kept & (trained == 0))
    if len(empty):
        first = int(empty[0])
        row, truncated = int(table["row"][first]), bool(table["truncated"][first])
        raise untrained_row(row, truncated=truncated, where=where, seq_len=seq_len, like=f"{len(empty)} row(s)")


def untrained_row(row: int, *, truncated: bool, where: str, seq_len: int, like: str) -> ValueError:
    """The error for a kept document without one trained token (`like`: how many rows share it)."""
    why = (
        f"after its cut to data.seq_len={seq_len}"
        if truncated
        else "(nothing in it is a completion or an assistant turn)"
    )
    return ValueError(
        f"row {row} of {where} has no trained token {why}; {like} like it. Fix the row, raise "
        "--data.seq_len, or train on every token with --data.train_on all"
    )


def _pack(docs, name: str, *, root: Path, workers: int, spec: DataSpec):
    key = _key("pack", name, docs._fingerprint, spec.seq_len, spec.packing)
    return docs.map(
        windows,
        batched=True,
        batch_size=PACK_GROUP,
        fn_kwargs={"seq_len": spec.seq_len, "packing": spec.packing},
        remove_columns=docs.column_names,
        num_proc=workers if workers > 1 and len(docs) >= workers * PACK_GROUP else None,
        new_fingerprint=key,
        cache_file_name=str(root / "tokenized" / f"{name}-{key}.arrow"),
        desc="packing" if spec.packing else "batching",
    )


def _stats(docs, train, *, rows: int, held_out_rows: int, seq_len: int) -> DataStats:
    import pyarrow.compute as pc

    table = docs.with_format("numpy")
    kept = np.asarray(table["kept"], dtype=bool)
    truncated = np.asarray(table["truncated"], dtype=bool)
    lengths = pc.list_value_length(train.data.column("labels"))
    return DataStats(
        rows=rows,
        held_out_rows=held_out_rows,
        documents=int(kept.sum()),
        tokens=int(pc.sum(lengths).as_py() or 0),
        supervised_tokens=int(np.asarray(table["n_trained"])[kept].sum()),
        truncated_rows=int(len(np.unique(np.asarray(table["row"])[truncated]))),
        dropped_rows=int((~kept).sum()),
        windows=len(train),
        seq_len=seq_len,
    )
