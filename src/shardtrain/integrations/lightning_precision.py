"""The Lightning Trainer's precision plugins, as `integrations.lightning.ShardtrainStrategy` runs them.

The Trainer picks a plugin from `precision=`; the strategy swaps it for the matching one here:
the same plugin, except that gradient clipping by norm clips the global norm over every rank's
shards (`st.clip_grad_norm_`; torch's `clip_grad_norm_` over one rank's rows would clip each rank
differently), and that the mixed precisions run without autocast, `st.shard` gathering the
parameters in half precision instead ("16-mixed" scaling the loss with `st.GradScaler`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch.optim import Optimizer

from ._options import convert_precision
from ._wrapped import clip_by_value


class _ClipsShards:
    """Clipping over the sharded model the strategy set up (`sharded` is set by the strategy)."""

    sharded: nn.Module | None = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        from .. import clip_grad_norm_

        clip_grad_norm_(self._model(), clip_val)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: float) -> None:
        clip_by_value(self._model(), clip_val)

    def _model(self) -> nn.Module:
        if self.sharded is None:
            raise RuntimeError("clipping before ShardtrainStrategy.setup sharded the model")
        return self.sharded


class ShardtrainPrecision(_ClipsShards, Precision):
    """ "32-true"."""


class ShardtrainHalfPrecision(_ClipsShards, HalfPrecision):
    """ "bf16-true": the model is built and trained in bf16 (Lightning's own plugin casts it)."""


class ShardtrainMixedPrecision(_ClipsShards, MixedPrecision):
    """ "bf16-mixed" / "16-mixed": half-precision compute by `st.shard`, fp32 masters, no autocast."""

    def __init__(self, precision: str, device: str) -> None:
        from ..ops.grad_scaler import GradScaler

        super().__init__(precision, device, scaler=GradScaler(device) if precision == "16-mixed" else None)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        yield


def _identity(plugin: Precision) -> Precision:
    return plugin


_PRECISIONS = {
    Precision: lambda p: ShardtrainPrecision(),
    HalfPrecision: lambda p: ShardtrainHalfPrecision(p.precision),
    MixedPrecision: lambda p: ShardtrainMixedPrecision(p.precision, p.device),
    ShardtrainPrecision: _identity,
    ShardtrainHalfPrecision: _identity,
    ShardtrainMixedPrecision: _identity,
}


def shardtrain_precision(plugin: Precision) -> Precision:
    """The plugin the Trainer chose from `precision=`, turned into the one the strategy runs with."""
    return convert_precision(plugin, _PRECISIONS, host="Trainer")
