"""What a run trains on: the byte corpus of the built-in model, or the user's rows through the model's tokenizer.

    no tokenizer (built-in model, plain text)     train/data.py: UTF-8 bytes, contiguous windows
    a tokenizer (model.pretrained's own, or       shardtrain.data: rows read by datasets, tokenized,
    data.tokenizer)                               loss-masked and packed into windows

A pretrained folder without tokenizer files keeps the byte corpus for plain text, with a notice; rows
(a .jsonl, .parquet, ... or a saved dataset) always need a tokenizer. Unless data.val_fraction says
otherwise, every row of a user's data trains (no held-out split, no evaluation, as TRL and axolotl do)
and the byte corpus holds out a share for the held-out loss (sections.py's defaults). Checks run on every rank before
any communication; the tokenizing runs once per node (local rank 0 first, the others read its cache).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.batches import WindowBatches
from ..data.mixing import MixedBatches
from ..data.sources import is_structured, load_rows
from ..data.stream import StreamBatches
from .data import ByteTokenizer, TokenBatches, build_cache, corpus_files
from .sections import Config
from .source_section import source_labels
from .stream_inputs import held_out_files, pad_id, streamed_train, whole_mix_held_out

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True, kw_only=True)
class DataPlan:
    """The checked choice of data, made on every rank before any communication."""

    tokenizer: Any  # a transformers tokenizer, or None for the byte corpus
    corpus: tuple[Path, list[Path]] | None  # the byte corpus's (root, files)
    notice: str | None = None


@dataclass(frozen=True, kw_only=True)
class TrainData:
    train: TokenBatches | WindowBatches | StreamBatches
    held_out: TokenBatches | WindowBatches | None  # None: nothing held out, nothing evaluated
    tokenizer: Any
    packed: bool  # windows hold several documents: the forward needs their position_ids
    stats: Any = None  # shardtrain.data's DataStats of the rows' path, or MixStats of several sources
    prompts: list[dict] | None = None
    # with several sources: (label, held-out windows) of each source holding rows out, evaluated one by one
    held_out_sources: tuple[tuple[str, WindowBatches], ...] = ()

    def show(self, count: int) -> str:
        """`--data.show`: the first `count` documents of each source, the trained spans marked; with several
        sources, each under its share of the trained tokens and (read through the cache) its rows and tokens."""
        from ..data.display import show

        if isinstance(self.train, StreamBatches):
            names = [s.where for s in self.train.sources]
            parts = [self.train.first_windows(s, count) for s in range(len(names))]
            lines = [
                f"{w:.1%} of the trained tokens aimed; its rows and tokens are counted as they stream (run summary)"
                for w in self.train.weights
            ]
        elif isinstance(self.train, MixedBatches):
            names, parts, lines = self.train.names, self.train.parts, self.stats.per_source()
        else:
            return show(self.train.windows, self.tokenizer, count=count)
        if len(parts) == 1:
            return show(parts[0], self.tokenizer, count=count)
        return "\n".join(
            f"=== source {n} ===\n{line}\n{show(part, self.tokenizer, count=count)}"
            for n, line, part in zip(names, lines, parts)
        )

    def close(self) -> None:
        """Stop the streamed data's reading threads (nothing to do for data read from the cache)."""
        if isinstance(self.train, StreamBatches):
            self.train.close()

    def describe(self, engine) -> str | None:
        """The data's statistics for the run summary; with several sources or streaming, each one's share of
        the tokens trained this run (an all-reduce of the ranks' counts: every rank calls this)."""
        if isinstance(self.train, StreamBatches):
            from ..data.stream import describe_served

            served = engine.all_reduce(torch.from_numpy(self.train.served), op="sum").cpu().numpy()
            names = [s.where for s in self.train.sources]
            return describe_served(names, weights=self.train.weights, served=served)
        if not isinstance(self.train, MixedBatches):
            return None if self.stats is None else self.stats.describe()
        trained = engine.all_reduce(torch.from_numpy(self.train.trained_tokens), op="sum")
        return self.stats.describe(trained.cpu().numpy())


def embedding_rows(module: nn.Module) -> int | None:
    """Rows of the model's input embedding (None for a model without one)."""
    get = getattr(module, "get_input_embeddings", None)
    embedding = get() if callable(get) else next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    return None if embedding is None else embedding.num_embeddings


def plan_data(cfg: Config, module: nn.Module, *, progress: bool = False) -> DataPlan:
    """The tokenizer and data source of the run; ValueError with the fix. `progress`: show reading bars."""
    data, pretrained = cfg.data, cfg.model.pretrained
    sources = data.source_list()
    structured = any(is_structured(s.path) for s in sources)
    notice = None
    path, key = (data.tokenizer, "data.tokenizer") if data.tokenizer else (pretrained, "model.pretrained")
    if key == "model.pretrained" and path is not None and not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        if structured:
            raise ValueError(
                f"model.pretrained={path!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)}) to read "
                f"data.path={data.path!r} with; pass --data.tokenizer FOLDER (the model's tokenizer)"
            )
        notice = (
            f"model.pretrained {path} holds no tokenizer: training on UTF-8 bytes (ids 0-255); pass "
            "--data.tokenizer FOLDER to fine-tune on the model's own tokens"
        )
        path = None
    rows = embedding_rows(module)
    if path is None and data.chat_template is not None:
        raise ValueError(
            f"data.chat_template={data.chat_template!r} needs a tokenizer to render chats with; pass "
            "--model.pretrained DIR or --data.tokenizer FOLDER"
        )
    if path is None:
        if data.streaming:
            raise ValueError(
                "data.streaming reads rows through a tokenizer; pass --data.tokenizer FOLDER (a Hugging Face "
                "tokenizer) or --model.pretrained DIR, or train the byte corpus without --data.streaming"
            )
        if data.sources:
            raise ValueError(
                f"data.sources ({len(data.sources)} sources) are read through a tokenizer; pass --data.tokenizer "
                "FOLDER (a Hugging Face tokenizer) or --model.pretrained DIR"
            )
        if structured:
            raise ValueError(
                f"data.path={data.path!r} holds rows, which need a tokenizer; the byte tokenizer reads only "
                "plain text: pass --data.tokenizer FOLDER (a Hugging Face tokenizer) or --model.pretrained DIR"
            )
        if rows is not None and rows < ByteTokenizer.vocab_size:
            raise ValueError(
                f"the byte tokenizer has {ByteTokenizer.vocab_size} tokens but the model's embedding has {rows} "
                f"rows; give the model a vocabulary of at least 256 (e.g. --model.kwargs.vocab_size 256)"
            )
        return DataPlan(tokenizer=None, corpus=corpus_files(data.path, data.pattern), notice=notice)
    from ..data.tokenizer import check_vocab, load_tokenizer

    tokenizer = load_tokenizer(path, key=key, chat_template=data.chat_template)
    if rows is not None:
        check_vocab(tokenizer, embedding_rows=rows, where=f"{key}={path!r}")
    if not sources:
        raise ValueError(
            f"a tokenizer ({key}={path!r}) trains on your data: pass --data.path (a .jsonl, .parquet, ... "
            "file, a folder of them, or plain text)"
        )
    held_specs = [*data_specs(cfg), whole_mix_held_out(cfg)]
    if cfg.eval.samples and not any(spec and (spec.eval_path or spec.val_fraction) for spec in held_specs):
        raise ValueError(
            f"eval.samples={cfg.eval.samples} decodes held-out prompts, but every row trains "
            "(data.val_fraction 0, no data.eval_path); hold rows out with --data.val_fraction 0.02 or "
            "--data.eval_path FILE, or pass --eval.samples 0"
        )
    from ..data.pipeline import read_source

    if cfg.train.objective == "dpo":  # preference pairs (data/preference_data.py), never packed
        from ..data.preference_data import read_pairs

        for spec in data_specs(cfg):
            read_pairs(spec, cache_dir=data.cache_dir)
        return DataPlan(tokenizer=tokenizer, corpus=None, notice=notice)
    for spec in data_specs(cfg):
        read_source(spec, tokenizer=tokenizer, cache_dir=data.cache_dir, progress=progress, streaming=data.streaming)
    if data.sources and data.eval_path is not None:  # the whole mix's held-out rows, read once the sources are
        load_rows(data.eval_path, key="data.eval_path", pattern=data.pattern, cache_dir=data.cache_dir)
    return DataPlan(tokenizer=tokenizer, corpus=None, notice=notice)


def data_specs(cfg: Config) -> list:
    """Each training source as shardtrain.data's DataSpec: its own fields, the data section's where it sets none."""
    from ..data.pipeline import DataSpec

    d = cfg.data
    return [
        DataSpec(
            path=s.path,
            config=s.config,
            split=s.split,
            revision=s.revision,
            eval_path=s.eval_path,
            format=s.format or d.format,
            columns=tuple(s.columns.items()),
            train_on=s.train_on or d.train_on,
            val_fraction=d.held_out_fraction(byte_corpus=False) if s.val_fraction is None else s.val_fraction,
            seq_len=d.seq_len,
            packing=d.packing,
            overlong=d.overlong,
            pattern=d.pattern,
            seed=cfg.train.seed,
        )
        for s in d.source_list()
    ]


def build_data(cfg: Config, engine, plan: DataPlan, *, micro_batch: int) -> TrainData:
    """Tokenize (or read from the cache) and batch the run's data on this rank."""
    # the ranks of one tensor-parallel group read the same rows
    order = dict(
        global_batch=micro_batch,
        rank=engine.data_parallel_rank,
        world_size=engine.data_parallel_size,
        seed=cfg.train.seed,
    )
    progress = cfg.run.progress and engine.local_rank == 0
    if plan.tokenizer is None:
        root, files = plan.corpus
        fraction = cfg.data.held_out_fraction(byte_corpus=True)
        with engine.rank_zero_first(local=True):
            cache = build_cache(
                root=root,
                files=files,
                val_fraction=fraction,
                cache_dir=cfg.data.cache_dir,
                tokenizer=ByteTokenizer(),
                progress=progress,
            )
        return TrainData(
            train=TokenBatches(cache.train, seq_len=cfg.data.seq_len, shuffle=True, **order),
            held_out=TokenBatches(cache.held_out, seq_len=cfg.data.seq_len, shuffle=False, **order)
            if fraction
            else None,
            tokenizer=None,
            packed=False,
        )
    if cfg.data.streaming:
        return _streamed(cfg, engine, plan, order=order, progress=progress)
    from ..data.pipeline import prepare

    d = cfg.data
    with engine.rank_zero_first(local=True):
        prepared = [
            prepare(
                spec,
                tokenizer=plan.tokenizer,
                cache_dir=d.cache_dir,
                num_proc=d.num_proc,
                progress=progress,
                prompts=cfg.eval.samples,
            )
            for spec in data_specs(cfg)
        ]
    tok = plan.tokenizer
    windows = dict(seq_len=d.seq_len, pad_id=pad_id(tok), **order)
    if len(prepared) == 1:
        train, stats = WindowBatches(prepared[0].train, shuffle=True, **windows), prepared[0].stats
    else:
        train, stats = _mixed(cfg, prepared, windows)
    mix = whole_mix_held_out(cfg)
    if mix is not None:  # data.eval_path beside data.sources: one held-out set for the mix
        ((mix_windows, mix_prompts),) = held_out_files(
            cfg, engine, [mix], tokenizer=tok, order=order, progress=progress
        )
        held, prompts = [("", mix_windows)], [mix_prompts]
    else:
        names = source_labels(d.source_list())
        held = [
            (n, WindowBatches(p.held_out, shuffle=False, **windows))
            for n, p in zip(names, prepared)
            if p.held_out is not None
        ]
        prompts = [p.prompts for p in prepared]
    return _with_held_out(cfg, train=train, held=held, tokenizer=tok, stats=stats, prompts=prompts)


def _with_held_out(cfg: Config, *, train, held: list, tokenizer, stats, prompts: list[list[dict]]) -> TrainData:
    """The run's TrainData with `held`, each source's (label, held-out windows): the first one alone,
    or with several, each one evaluated on its own (held_out then stands for all of them); eval.samples
    prompts taken from the sources in turn."""
    return TrainData(
        train=train,
        held_out=held[0][1] if held else None,
        held_out_sources=tuple(held) if len(held) > 1 else (),
        tokenizer=tokenizer,
        packed=cfg.data.packing,
        stats=stats,
        prompts=[row for rows in itertools.zip_longest(*prompts) for row in rows if row][: cfg.eval.samples],
    )


def _mixed(cfg: Config, prepared: list, windows: dict) -> tuple[Any, Any]:
    """Several sources' windows in one seeded stream (data/mixing.py), and their statistics."""
    from ..data.mixing import MixStats, shares_of, source_name

    sources = cfg.data.source_list()
    names = [source_name(s.path, config=s.config, split=s.split) for s in sources]
    shares, epoch_samples = shares_of(
        windows=[len(p.train) for p in prepared],
        trained=[p.stats.supervised_tokens for p in prepared],
        weights=[s.weight for s in sources],
        epochs=[s.epochs for s in sources],
    )
    train = MixedBatches(
        [p.train for p in prepared], names=names, shares=shares, epoch_samples=epoch_samples, **windows
    )
    return train, MixStats(names=names, stats=[p.stats for p in prepared], shares=shares)


def _streamed(cfg: Config, engine, plan: DataPlan, *, order: dict, progress: bool) -> TrainData:
    """data.streaming: every source's rows read, tokenized and packed as training goes (stream_inputs.py)."""
    specs, tok, names = data_specs(cfg), plan.tokenizer, source_labels(cfg.data.source_list())
    train = streamed_train(cfg, specs, names, tokenizer=tok, order=order)
    mix = whole_mix_held_out(cfg)
    held_specs, names = ([mix], [""]) if mix is not None else (specs, names)
    parts = held_out_files(cfg, engine, held_specs, tokenizer=tok, order=order, progress=progress)
    held = [(name, windows) for name, (windows, _) in zip(names, parts) if windows is not None]
    return _with_held_out(cfg, train=train, held=held, tokenizer=tok, stats=None, prompts=[p for _, p in parts])
