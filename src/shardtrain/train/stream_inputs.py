"""data.streaming's training data: every source's rows read, tokenized and packed as training goes.

Each source streams this rank's share of its rows (data/stream.py); with several sources each window
comes from the one furthest below its weight's share of the trained tokens. Held-out rows come only
from eval_path files (data.eval_path, or each source's own), tokenized once through the cache as
without streaming, each source's evaluated on its own (eval/loss/<source>).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

from ..data.batches import WindowBatches
from ..data.stream import StreamBatches, StreamSource, stream_rows
from .sections import Config


def streamed_train(cfg: Config, specs: list, names: list[str], *, tokenizer, order: dict[str, Any]) -> StreamBatches:
    """The training batches of this rank: one stream per source of `specs` (DataSpecs), named `names`."""
    from ..data.pipeline import encoder_of, read_source

    d = cfg.data
    share = dict(tokenizer=tokenizer, cache_dir=d.cache_dir, rank=order["rank"], world_size=order["world_size"])
    sources = []
    for spec, name in zip(specs, names):
        _, fmt = read_source(spec, tokenizer=tokenizer, cache_dir=d.cache_dir, progress=False, streaming=True)
        sources.append(
            StreamSource(
                open_rows=functools.partial(stream_rows, spec, **share),
                # the reading thread encodes with its own copy: a fast tokenizer is not to be shared across threads
                encoder=encoder_of(spec, fmt, tokenizer=copy.deepcopy(tokenizer)),
                where=f"data.path={spec.path!r}",
                name=name,
            )
        )
    weights = [s.weight for s in d.source_list()]
    batches = StreamBatches(
        sources,
        weights=weights if None not in weights else None,
        pad_id=pad_id(tokenizer),
        packing=d.packing,
        buffer=d.stream_buffer,
        **order,
    )
    batches.start()  # the first buffers are read while the model is built
    return batches


def held_out_files(cfg: Config, engine, specs: list, *, tokenizer, order: dict, progress: bool) -> list:
    """(held-out windows, held-out prompts for eval.samples) of each of `specs`: WindowBatches of its
    eval_path tokenized once through the cache (None without one)."""
    from ..data.pipeline import prepare, read_source
    from ..data.prompts import held_out_prompts

    d = cfg.data
    parts = []
    for spec in specs:
        if spec.eval_path is None:
            parts.append((None, []))
            continue
        held = dataclasses.replace(spec, path=spec.eval_path, eval_path=None, config=None, split="train", revision=None)
        with engine.rank_zero_first(local=True):
            prepared = prepare(held, tokenizer=tokenizer, cache_dir=d.cache_dir, num_proc=d.num_proc, progress=progress)
        prompts = []
        if cfg.eval.samples:
            rows, fmt = read_source(held, tokenizer=tokenizer, cache_dir=d.cache_dir, progress=False)
            prompts = held_out_prompts(rows, fmt, tokenizer, count=cfg.eval.samples)
        windows = WindowBatches(prepared.train, shuffle=False, seq_len=d.seq_len, pad_id=pad_id(tokenizer), **order)
        parts.append((windows, prompts))
    return parts


def whole_mix_held_out(cfg: Config):
    """data.eval_path beside data.sources as a DataSpec (the mix's held-out rows, as the data section reads
    them); None without it."""
    from ..data.pipeline import DataSpec

    d = cfg.data
    if not (d.sources and d.eval_path):
        return None
    return DataSpec(
        path=d.eval_path,
        eval_path=d.eval_path,
        format=d.format,
        train_on=d.train_on,
        seq_len=d.seq_len,
        packing=d.packing,
        overlong=d.overlong,
        pattern=d.pattern,
        seed=cfg.train.seed,
    )


def pad_id(tokenizer) -> int:
    """The id padding rows are filled with (masked by their labels and positions, never compared)."""
    return next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)
