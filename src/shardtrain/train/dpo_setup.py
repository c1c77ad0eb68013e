"""Setting up a DPO run (train.objective dpo): its checks, its pair batches and its reference log-probabilities.

The checks run on every rank before any communication, like the rest of the job's (loop.py's `_prepare`).
`dpo_fields` builds what `DpoJob` adds to a job once the model is sharded and its weights loaded: the
reference (dpo_ref.py: adapters off, a frozen copy, or the precomputed tables, cached beside the pairs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn

from .dpo_ref import (
    LiveReference,
    PrecomputedReference,
    cache_path,
    frozen_copy,
    load_or_store,
    precompute,
    weights_key,
)
from .inputs import DataPlan, TrainData, data_specs, pad_id
from .sections import Config


def is_dpo(cfg: Config) -> bool:
    return cfg.train.objective == "dpo"


def check_dpo_config(cfg: Config) -> None:
    """The option combinations DPO cannot run; ValueError with the fix."""
    if not is_dpo(cfg):
        return
    d = cfg.data
    refusals = (
        (d.path is None, "data.path", None, "give the preference rows (prompt / chosen / rejected) with --data.path"),
        (bool(d.sources), "data.sources", len(d.sources), "DPO reads one source: give it with --data.path"),
        (d.streaming, "data.streaming", True, "the pairs are tokenized once and cached: drop --data.streaming"),
        (
            cfg.engine.tp > 1,
            "engine.tp",
            cfg.engine.tp,
            "DPO runs with --engine.tp 1 (the model sharded over every rank)",
        ),
        (cfg.train.chunked_loss is True, "train.chunked_loss", True, "DPO scores answers from the logits: drop it"),
        (
            bool(cfg.eval.samples),
            "eval.samples",
            cfg.eval.samples,
            "DPO rows hold no held-out prompts to decode: pass 0",
        ),
    )
    for refused, key, value, fix in refusals:
        if refused:
            raise ValueError(f"train.objective=dpo with {key}={value!r}: {fix}")


def build_pair_data(cfg: Config, engine, plan: DataPlan, *, micro_batch: int) -> tuple[TrainData, Any]:
    """This rank's batches of training and held-out pairs, and the prepared pairs (tokenized once per node)."""
    from ..data.preference_data import PairBatches, prepare_pairs

    (spec,) = data_specs(cfg)
    with engine.rank_zero_first(local=True):
        prepared = prepare_pairs(spec, tokenizer=plan.tokenizer, cache_dir=cfg.data.cache_dir)
    common = dict(
        seq_len=cfg.data.seq_len,
        pad_id=pad_id(plan.tokenizer),
        global_batch=micro_batch,
        rank=engine.data_parallel_rank,
        world_size=engine.data_parallel_size,
        seed=cfg.train.seed,
    )
    data = TrainData(
        train=PairBatches(prepared.train, shuffle=True, **common),
        held_out=None if prepared.held_out is None else PairBatches(prepared.held_out, shuffle=False, **common),
        tokenizer=plan.tokenizer,
        packed=False,
        stats=prepared,
    )
    return data, prepared


def dpo_fields(cfg: Config, engine, *, model: nn.Module, data: TrainData, prepared: Any) -> dict[str, Any]:
    """`DpoJob`'s own fields: beta and the reference, taken from the sharded `model` as it is now (its
    starting weights). A full fine-tune's frozen copy is the model built again, in the compute dtype under
    mixed precision (it needs no fp32 master), sharded like it and given its rows."""
    lora = bool(cfg.lora.rank)
    if lora or cfg.dpo.precompute_ref:
        live = LiveReference(model=model, adapters_off=lora)
    else:
        from .model_builder import build_model

        dtype = engine.mixed_precision.param_dtype
        dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        built = build_model(cfg.model, init_context=engine.init_module, dtype=dtype)
        built.module.requires_grad_(False)
        copy = engine.setup(built.module, wrap=built.wrap, activation_checkpointing=None)
        live = LiveReference(model=frozen_copy(model, copy), adapters_off=False)
    if not cfg.dpo.precompute_ref:
        return {"beta": cfg.dpo.beta, "loss": cfg.dpo.loss, "reference": live}
    order = dict(seq_len=cfg.data.seq_len, pad_id=pad_id(data.tokenizer), shuffle=False)

    def compute() -> dict[str, np.ndarray]:
        from ..data.preference_data import PairBatches

        tables = {}
        for name, pairs in (("train", prepared.train), ("held_out", prepared.held_out)):
            if pairs is not None:
                batches = PairBatches(pairs, **order, **_order_of(data.train))
                tables[name] = precompute(live, batches, engine=engine, to_device=_on(engine.device)).numpy()
        return tables

    key = {
        "model": dataclasses.asdict(cfg.model),
        "lora": lora,
        "seed": cfg.train.seed,
        "precision": engine.precision,
        "weights": weights_key(cfg.model.pretrained),
    }
    tables = load_or_store(
        cache_path(cache_dir=cfg.data.cache_dir, pairs_key=prepared.key, model_key=key), compute, engine=engine
    )
    device = engine.device
    held = tables.get("held_out")
    return {
        "beta": cfg.dpo.beta,
        "loss": cfg.dpo.loss,
        "reference": PrecomputedReference(
            train=torch.from_numpy(tables["train"]).to(device),
            held_out=None if held is None else torch.from_numpy(held).to(device),
        ),
    }


def _order_of(batches) -> dict[str, int]:
    world = batches.global_batch // batches.per_rank
    return dict(global_batch=batches.global_batch, rank=batches.rank, world_size=world, seed=batches.seed)


def _on(device: torch.device):
    return lambda batch: {k: t.to(device) for k, t in batch.items()}
