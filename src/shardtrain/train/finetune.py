"""The main job's fine-tuning steps: LoRA before sharding, pretrained weights after, export at the end.

model.pretrained DIR   build on meta (model_builder.py) -> [LoRA] -> st.shard -> st.load_pretrained(DIR)
lora.rank r > 0        peft adapters on lora.targets; only they train; the frozen base is built in
                       the compute dtype under mixed precision (it needs no fp32 master); checkpoints
                       hold the adapters and their optimizer state only (params="trainable"), and
                       a resume reloads the base from DIR first
lora.base_bits 4       QLoRA: the frozen linear layers (not the head) in NF4 (pretrained/qlora.py),
                       quantised as DIR is read; export dequantises (and merges) into a 16-bit folder
run.export_hf          runs/<name>/hf/: the model (or the adapters, or the merged model)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..policy import MixedPrecision
from .sections import Config


def check_finetune_config(cfg: Config) -> None:
    """The option combinations that cannot work; ValueError with the fix (before any communication)."""
    lora, run = cfg.lora, cfg.run
    if lora.rank and cfg.model.pretrained is None:
        raise ValueError(
            f"lora.rank={lora.rank} trains adapters over pretrained weights; pass --model.pretrained "
            "DIR (a Hugging Face model folder), or --lora.rank 0 for full training"
        )
    if lora.rank and cfg.engine.tp > 1:
        raise ValueError(
            f"lora.rank={lora.rank} with engine.tp={cfg.engine.tp}: tensor parallelism does not split LoRA adapters "
            "yet; train them with --engine.tp 1 (the frozen base sharded over every rank), or fully fine-tune "
            "with --lora.rank 0"
        )
    if lora.bits != 16 and not lora.rank:
        raise ValueError(
            f"lora.base_bits={lora.bits} quantises the frozen base under LoRA adapters; pass --lora.rank R "
            "(e.g. 8) with it, or drop it for full training"
        )
    if lora.merge_on_export and not (lora.rank and run.export_hf):
        raise ValueError(
            "lora.merge_on_export=true merges LoRA adapters into the exported model; it needs "
            "--lora.rank R and --run.export_hf true"
        )
    if run.export_hf and cfg.model.pretrained is None and cfg.model.name != "hf":
        raise ValueError(
            f"run.export_hf=true writes a Hugging Face folder, but model.name={cfg.model.name!r} is not "
            "a Hugging Face model; use st.save_checkpoint's full format (shardtrain convert) instead"
        )


def build_dtype(cfg: Config, precision: MixedPrecision) -> torch.dtype:
    """The dtype a pretrained model is built in: fp32, except a LoRA base under mixed precision, which
    is frozen and so is stored in the compute dtype (trainable parameters keep fp32 masters anyway)."""
    if cfg.lora.rank and precision.param_dtype in (torch.bfloat16, torch.float16):
        return precision.param_dtype
    return torch.float32


def with_lora(cfg: Config, model: nn.Module) -> tuple[nn.Module, Callable[[nn.Module], None] | None]:
    """`model` with LoRA adapters (and the `param_init_fn` that initialises them in `st.shard`), or as is."""
    if not cfg.lora.rank:
        return model, None
    from ..pretrained.lora import adapter_init, apply_lora

    lora = cfg.lora
    peft_model = apply_lora(model, rank=lora.rank, alpha=lora.alpha, targets=lora.targets, dropout=lora.dropout)
    init = adapter_init(peft_model)
    if lora.bits != 16:
        from ..pretrained.qlora import quantize_base

        init = quantize_base(peft_model, bits=lora.bits, param_init_fn=init)
    return peft_model, init


def describe_lora(cfg: Config, model: nn.Module, base: str) -> str:
    """`base` (the built model's description), followed by the adapters and what trains when lora.rank > 0."""
    if not cfg.lora.rank:
        return base
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    four = ", over a 4-bit (NF4) base" if cfg.lora.bits == 4 else ""
    return f"{base}, LoRA r={cfg.lora.rank} on {','.join(cfg.lora.targets)}{four}: {trainable / 1e6:.2f}M trainable"


def checkpoint_params(cfg: Config) -> str:
    """What checkpoints hold: with LoRA only the trainable adapters (the base is the pretrained folder)."""
    return "trainable" if cfg.lora.rank else "all"


def load_base(cfg: Config, model: nn.Module) -> str | None:
    """Load model.pretrained into the sharded model (every rank its rows); a line saying what was loaded."""
    from ..pretrained import install_save_pretrained, load_pretrained

    if cfg.model.pretrained is None:
        install_save_pretrained(model)
        return None
    return load_pretrained(model, cfg.model.pretrained).describe()


def export(cfg: Config, model: nn.Module, run_dir: Path) -> Path:
    """run.export_hf: write runs/<name>/hf/ (every rank gathers, rank 0 writes)."""
    from ..pretrained import save_pretrained

    dtype = None if cfg.run.export_dtype == "master" else getattr(torch, cfg.run.export_dtype)
    return save_pretrained(model, run_dir / "hf", dtype=dtype, merge_lora=cfg.lora.merge_on_export)
