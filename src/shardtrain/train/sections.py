"""The sections of the main job's configuration: typed, frozen, each key with its help and default.

Every key has a type and a default, so `shardtrain train` runs with no file at all; `__post_init__`
checks each value and names the key and the fix. This file holds the model, LoRA, data and eval sections
and the whole `Config`; run_sections.py the optimizer, training, engine and run sections. Reading files
and `--section.key value` overrides into these sections is config.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..data.encode import Overlong, TrainOn
from ..data.formats import FORMAT_NAMES
from ..data.pipeline import PACK_GROUP, DataSpec
from .dpo_section import DpoConfig
from .run_sections import EngineConfig, OptimConfig, RunConfig, TrainConfig
from .section_fields import ConfigError
from .section_fields import help_field as _help
from .section_fields import require as _require
from .source_section import SourceConfig, check_sources

__all__ = [
    "ALL_LINEAR",
    "BYTE_VAL_FRACTION",
    "Config",
    "ConfigError",
    "DataConfig",
    "DpoConfig",
    "EngineConfig",
    "EvalConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "TrainConfig",
]

# The data section's fields that shardtrain.data's DataSpec also has take DataSpec's defaults: one source.
_SPEC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DataSpec)}
# data.val_fraction unset on the byte corpus: the main job reports a held-out loss, evaluated whole, so
# the share is small (the standard library: a few files, a handful of batches, as cheap as a few steps).
BYTE_VAL_FRACTION = 0.003
ALL_LINEAR = "all-linear"  # peft's shorthand for every linear layer but the output head


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = _help(
        "built-in 'llama-<size>' (tiny, 2m, 7m, 34m, 125m, 1.5b, 8b, ...), 'hf' for a "
        "Hugging Face causal LM from model.hf_config, or 'package.module:factory' (this imports that "
        "module and calls the function: it runs that code, so use only a config you trust)",
        "llama-2m",
    )
    kwargs: dict[str, Any] = _help(
        "overrides: LlamaConfig fields, Hugging Face config fields, or factory "
        "keyword arguments (e.g. --model.kwargs.n_layers 2)",
        default_factory=dict,
    )
    hf_config: str | None = _help(
        "Hugging Face config: a config.json or a directory holding one "
        "(or give model.kwargs.model_type instead); the model starts from random weights, "
        "even where the directory holds weights (use model.pretrained for those)",
        None,
    )
    pretrained: str | None = _help(
        "a Hugging Face model folder (config.json + safetensors weights), or a Hub model id "
        "(org/name: its config, tokenizer and safetensors downloaded once per node into the HF cache, "
        "or read from it offline, HF_HUB_OFFLINE=1), to fine-tune: the model is built from its config on "
        "the meta device, sharded, and each rank reads only its rows of the weights (implies model.name 'hf')",
        None,
    )
    wrap: tuple[str, ...] = _help(
        "module class names that become sharding units "
        "(default: Llama's Block, with Embedding and OutputHead from llama-34m up, or the HF "
        "model's _no_split_modules)",
        (),
    )
    activation_checkpointing: bool | int = _help(
        "recompute the wrapped blocks' activations in backward: true (every block), false, or k (1 block in k)", False
    )

    def __post_init__(self) -> None:
        ac = self.activation_checkpointing
        _require(
            isinstance(ac, bool) or (isinstance(ac, int) and ac >= 0),
            "model.activation_checkpointing",
            ac,
            "use true (every block), false, or k >= 2 (1 block in k)",
        )


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    rank: int = _help(
        "LoRA rank r (0: off, every parameter trains). r > 0 (with model.pretrained) adds peft's LoRA "
        "adapters to lora.targets and trains only them; checkpoints then hold only the adapters and "
        "their optimizer state, and resuming reloads the base from model.pretrained",
        0,
    )
    alpha: float = _help("LoRA alpha: the adapters' update is scaled by alpha / rank", 16.0)
    targets: tuple[str, ...] = _help(
        f"names of the linear layers that get adapters (comma-separated), or {ALL_LINEAR} (peft's shorthand: "
        "every linear layer but the output head)",
        ("q_proj", "v_proj"),
    )
    dropout: float = _help("dropout on the adapters' input", 0.0)
    merge_on_export: bool = _help(
        "with run.export_hf: export the model with the adapters merged into its weights "
        "(W + B @ A * alpha / rank), a plain Hugging Face folder, instead of the adapters "
        "alone in peft's format",
        False,
    )
    base_bits: int = _help(
        "bits of the frozen base: 16 (as built), or 4 (QLoRA: every frozen linear layer but the output head "
        "stored in NF4 with double-quantised scales, sharded like any frozen parameter, quantised as "
        "model.pretrained is read; needs torchao: pip install 'shardtrain[qlora]')",
        16,
    )
    load_in_4bit: bool = _help("transformers' spelling of lora.base_bits 4", False)

    def __post_init__(self) -> None:
        _require(self.rank >= 0, "lora.rank", self.rank, "use 0 (off) or a positive rank such as 8")
        _require(self.alpha > 0, "lora.alpha", self.alpha, "use a positive scale such as 16")
        _require(0 <= self.dropout < 1, "lora.dropout", self.dropout, "use a value in [0, 1)")
        _require(bool(self.targets), "lora.targets", self.targets, "name at least one layer, e.g. q_proj,v_proj")
        _require(
            ALL_LINEAR not in self.targets or len(self.targets) == 1,
            "lora.targets",
            ",".join(self.targets),
            f"{ALL_LINEAR} already names every linear layer: pass it alone, or list the layers",
        )
        _require(self.base_bits in (4, 16), "lora.base_bits", self.base_bits, "use 16 (off) or 4 (an NF4 base)")

    @property
    def bits(self) -> int:
        """The frozen base's bits: 4 with lora.base_bits 4 or lora.load_in_4bit, else 16."""
        return 4 if self.load_in_4bit else self.base_bits


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    path: str | None = _help(
        "the training data: a .jsonl/.json/.parquet/.arrow/.csv file, a folder of them, a folder "
        "Dataset.save_to_disk wrote, plain text files, a Hub dataset id (org/name: downloaded into the HF "
        "cache, or read from it offline) or a Hub dataset repo's folder (default: the Python standard "
        "library's own .py files, as bytes for the built-in model)",
        None,
    )
    config: str | None = _help(
        "the config (subset) of a Hub dataset, as its README's configs name it (default: its default)",
        _SPEC_DEFAULTS["config"],
    )
    split: str = _help("the split of a Hub dataset (or of a saved DatasetDict) to train on", _SPEC_DEFAULTS["split"])
    revision: str | None = _help(
        "the branch, tag or commit of a Hub dataset id (default: main)", _SPEC_DEFAULTS["revision"]
    )
    sources: tuple[SourceConfig, ...] = _help(
        "several training sources instead of data.path: [[data.sources]] tables (TOML) or a list (YAML), each "
        "with path, config, split, revision, format, columns (a rename map), train_on, weight or epochs, "
        "eval_path, val_fraction; --data.sources.1.weight 0.3 sets one item (docs/data.md)",
        (),
    )
    pattern: str = _help("glob of the plain text files to read under a folder", "**/*.py")
    seq_len: int = _help("tokens per training sequence (a packed window)", 256)
    val_fraction: float | None = _help(
        "fraction held out for evaluation, 0 = none (every row trains, no evaluation): of the rows (for "
        "text read as bytes, of the files; of the tokens where there are too few files, e.g. a single one: "
        "its last part). Default: 0 for data read through a tokenizer (as TRL and axolotl), "
        f"{BYTE_VAL_FRACTION} for the built-in model's byte corpus",
        None,
    )
    eval_path: str | None = _help(
        "held-out data in the same layout as data.path (instead of data.val_fraction); with data.sources, the "
        "whole mix's held-out rows (read with data.format and data.train_on)",
        None,
    )
    tokenizer: str | None = _help(
        "a Hugging Face tokenizer folder (default: model.pretrained's own; the byte tokenizer for the built-in model)",
        None,
    )
    format: str = _help(
        "row layout: 'auto' (from the columns: text, prompt + completion, messages or ShareGPT's "
        "conversations), 'text', 'prompt_completion' or 'messages'",
        _SPEC_DEFAULTS["format"],
    )
    train_on: str = _help(
        "tokens the loss is taken on: 'completion' (the completion, or the assistant turns of a chat) or 'all'",
        _SPEC_DEFAULTS["train_on"],
    )
    packing: bool = _help(
        "pack rows into seq_len windows, positions restarting at each row and no attention across "
        "rows (false: one padded row per sequence)",
        _SPEC_DEFAULTS["packing"],
    )
    overlong: str = _help(
        "a row longer than seq_len: 'truncate' (keep its start) or 'drop' (counted)", _SPEC_DEFAULTS["overlong"]
    )
    num_proc: int = _help("processes that tokenize and pack (0: one per 2,000 rows, up to the CPU count)", 0)
    streaming: bool = _help(
        "read, tokenize and pack the rows as training goes, nothing cached: the first step starts at once and "
        "a corpus larger than the disk trains (several sources mix by weight; held-out rows only from eval_path "
        "files; not with train.epochs)",
        False,
    )
    stream_buffer: int = _help("with data.streaming: documents packed together (best-fit within them)", PACK_GROUP)
    show: int = _help("print this many decoded training rows with the trained spans in [[ ]] before training", 0)
    cache_dir: str | None = _help("where the tokenized data is cached (default: ~/.cache/shardtrain)", None)
    chat_template: str | None = _help(
        "the chat template to train with and export: a Jinja file, or the name of a template the tokenizer "
        "ships (default: the tokenizer's own)",
        None,
    )

    def held_out_fraction(self, *, byte_corpus: bool) -> float:
        """data.val_fraction, or its default for the data source when unset."""
        if self.val_fraction is not None:
            return self.val_fraction
        return BYTE_VAL_FRACTION if byte_corpus else _SPEC_DEFAULTS["val_fraction"]

    def source_list(self) -> tuple[SourceConfig, ...]:
        """The training sources: data.sources, or data.path's one (None: the byte corpus, no source)."""
        if self.sources or self.path is None:
            return self.sources
        return (
            SourceConfig(
                path=self.path, config=self.config, split=self.split, revision=self.revision, eval_path=self.eval_path
            ),
        )

    def __post_init__(self) -> None:
        check_sources(self.sources, path=self.path, streaming=self.streaming, require=_require)
        _require(
            not (self.eval_path is not None and any(s.eval_path or s.val_fraction for s in self.sources)),
            "data.eval_path",
            self.eval_path,
            "hold rows out for the whole mix (data.eval_path) or per source (their eval_path, val_fraction), not both",
        )
        _require(self.seq_len >= 2, "data.seq_len", self.seq_len, "use at least 2 tokens")
        _require(
            self.val_fraction is None or 0 <= self.val_fraction < 1,
            "data.val_fraction",
            self.val_fraction,
            "use a value in [0, 1) (0: hold out nothing)",
        )
        for key, value, choices in (
            ("data.format", self.format, FORMAT_NAMES),
            ("data.train_on", self.train_on, tuple(t.value for t in TrainOn)),
            ("data.overlong", self.overlong, tuple(o.value for o in Overlong)),
        ):
            _require(value in choices, key, value, f"use one of {', '.join(choices)}")
        _require(self.num_proc >= 0, "data.num_proc", self.num_proc, "use 0 (automatic) or more")
        _require(self.stream_buffer >= 1, "data.stream_buffer", self.stream_buffer, "use 1 or more documents")
        _require(
            not (self.streaming and self.val_fraction),
            "data.val_fraction",
            self.val_fraction,
            "streamed rows are never counted, so none are held out by a fraction: use --data.eval_path FILE",
        )
        _require(self.show >= 0, "data.show", self.show, "use 0 (off) or more")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    samples: int = _help(
        "greedy-decode this many held-out prompts at each evaluation (on every rank, in step) into "
        "runs/<name>/samples.jsonl (0: off)",
        0,
    )
    max_new_tokens: int = _help("tokens generated per sample at most", 32)

    def __post_init__(self) -> None:
        _require(self.samples >= 0, "eval.samples", self.samples, "use 0 (off) or more")
        _require(self.max_new_tokens >= 1, "eval.max_new_tokens", self.max_new_tokens, "use 1 or more")


@dataclass(frozen=True, kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    run: RunConfig = field(default_factory=RunConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)

    def __post_init__(self) -> None:
        _require(
            not (self.data.streaming and self.train.epochs),
            "train.epochs",
            self.train.epochs,
            "streamed data is never counted, so passes over it cannot be: give --train.steps with --data.streaming",
        )
        _require(
            not (self.train.float8 and self.engine.tp > 1),
            "train.float8",
            self.train.float8,
            f"float8 Linears split over engine.tp={self.engine.tp} ranks need torchao's float8 parallel styles, "
            "which the engine's plans do not use: give --engine.tp 1 or --train.float8 false",
        )
        _require(
            not (self.train.float8 and self.lora.bits == 4),
            "train.float8",
            self.train.float8,
            f"with lora.base_bits={self.lora.bits} (QLoRA) no Linear would train in float8 (the frozen ones are "
            "4-bit NF4, the adapters too small): give --train.float8 false, or --lora.base_bits 16 to keep float8",
        )
