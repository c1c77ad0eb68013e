"""Where DPO's reference log-probabilities come from, on every rank, for a batch of pairs (data/preference_data.py).

    LoRA (lora.rank > 0)     the trained model itself with its adapters disabled (peft's `disable_adapter`):
                             the frozen base, no second model in memory
    full fine-tuning         a frozen copy of the model as it starts, sharded like it (no gradient storage, no
                             optimizer state; in the compute dtype under mixed precision): `frozen_copy`
    dpo.precompute_ref       either of the above run once over every pair before training (`precompute`), the
                             results cached beside the tokenized pairs; a full fine-tune then holds no copy

Every answer's log-probability is the sum over its tokens, in fp32, under `torch.no_grad`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..core.sharded_param import local_of
from ..data.pipeline import cache_root
from .dpo_loss import sequence_logps
from .packed import forward_logits

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class LiveReference:
    """The reference model run on each batch: `model` (a frozen copy), or the policy with its adapters off."""

    model: nn.Module
    adapters_off: bool

    @torch.no_grad()
    def logps(self, batch: Batch, *, held_out: bool = False) -> torch.Tensor:
        """The reference's log-probability of each row of `batch` (the n chosen answers, then the n rejected)."""
        off = self.model.disable_adapter() if self.adapters_off else contextlib.nullcontext()
        with off:
            logits = forward_logits(self.model, batch["input_ids"], position_ids=None)
        return sequence_logps(logits, batch["labels"])


@dataclass(frozen=True, kw_only=True)
class PrecomputedReference:
    """Reference log-probabilities computed once: [pairs, 2] tables (chosen, rejected) of the training and
    held-out pairs, looked up by each batch's pair numbers (a padding pair reads 0: it scores nothing)."""

    train: torch.Tensor
    held_out: torch.Tensor | None

    def logps(self, batch: Batch, *, held_out: bool = False) -> torch.Tensor:
        table = self.held_out if held_out else self.train
        pair = batch["pair"].to(table.device)
        rows = table[pair.clamp(min=0)] * (pair >= 0).unsqueeze(-1)
        return torch.cat([rows[:, 0], rows[:, 1]])


def frozen_copy(policy: nn.Module, copy: nn.Module) -> nn.Module:
    """`copy` (the same model built again and sharded like `policy`, frozen) holding `policy`'s rows now."""
    weights = dict(policy.named_parameters())
    weights.update(policy.named_buffers())
    with torch.no_grad():
        for name, tensor in [*copy.named_parameters(), *copy.named_buffers()]:
            local_of(tensor).copy_(local_of(weights[name]))
    copy.requires_grad_(False)
    return copy


def precompute(reference: LiveReference, batches, *, engine, to_device) -> torch.Tensor:
    """[pairs, 2] reference log-probabilities of every pair `batches` (held-out order, PairBatches) holds:
    every rank runs the same forwards on its slice of each micro-batch; one all-gather per batch collects them."""
    table = torch.zeros(batches.num_windows, 2, dtype=torch.float32)
    for index in range(batches.held_out_batches(0)):
        batch = to_device(batches.batch(index))
        logps = reference.logps(batch)
        n = batch["pair"].numel()
        mine = torch.cat([batch["pair"].to(logps).unsqueeze(-1), logps.view(2, n).T], dim=-1)
        for pair, chosen, rejected in engine.all_gather(mine).flatten(0, 1).tolist():
            if pair >= 0:
                table[int(pair)] = torch.tensor([chosen, rejected])
    return table


def cache_path(*, cache_dir: str | None, pairs_key: str, model_key: dict) -> Path:
    """Where the precomputed log-probabilities of the tokenized pairs `pairs_key` under the reference
    described by `model_key` (the model, its weights' files, the seed and precision) are cached."""
    digest = hashlib.sha256(json.dumps(model_key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root(cache_dir) / "dpo-ref" / f"{pairs_key}-{digest}.npz"


def weights_key(pretrained: str | None) -> list:
    """The pretrained folder's weight files (name, size, modification time): their change changes the cache key."""
    if pretrained is None or not Path(pretrained).is_dir():
        return [pretrained]
    files = sorted(Path(pretrained).glob("*.safetensors"))
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def load_or_store(path: Path, compute, *, engine) -> dict[str, np.ndarray]:
    """The cached tables at `path`, or `compute()` (every rank, collectively) written there by rank 0."""
    found = engine.broadcast(path.exists())
    if found:
        with np.load(path) as cached:
            return dict(cached)
    tables = compute()
    if engine.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp.npz")
        np.savez(partial, **tables)
        partial.replace(path)
    engine.barrier()
    return tables
