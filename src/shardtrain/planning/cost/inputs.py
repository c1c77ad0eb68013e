"""What a memory estimate is computed from, normalised and checked: `EstimateInputs`, and the parsers of
`st.estimate_memory`'s arguments (each ValueError names the value and the accepted forms)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...policy import CPUOffload, MixedPrecision
from ...strategy import Strategy
from .float8_cost import Float8Linears
from .model_spec import ModelSpec

OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 4}  # sgd: momentum buffer


@dataclass(frozen=True, kw_only=True)
class EstimateInputs:
    """Everything an estimate was computed from (normalised), so it can be recomputed for another batch."""

    model: ModelSpec
    world_size: int
    strategy: Strategy
    shard_size: int  # ranks one shard spans: world_size, the hybrid group, or 1 for no_shard
    precision: MixedPrecision
    recompute_every: int  # 0: no activation checkpointing, 1: every block, k: every k-th block
    offload: CPUOffload | None
    micro_batch: int
    seq_len: int
    optimizer: str
    optimizer_bytes: float
    in_flight: int
    keep_grads: bool
    device_memory: int | None
    tp: int = 1  # ranks each layer is split over; `model` is then what one of them holds (tensor_parallel.py)
    sequence_parallel: bool = False
    loss_parallel: bool = False
    chunked_loss: bool | str = False  # the loss in chunks (True), over the full logits (False), or "auto"
    float8: Float8Linears | None = None  # the Linears that train in float8 (None: float8 off)

    @property
    def param_bytes(self) -> int:
        return (self.precision.param_dtype or torch.float32).itemsize

    @property
    def frozen_param_bytes(self) -> float:
        """Bytes per frozen parameter as stored: a live module's own dtypes, else the compute dtype (the
        dtype `shardtrain train` builds a LoRA base in: `policy.storage_dtypes` keeps no master for it)."""
        m = self.model
        return m.frozen_bytes / m.frozen_params if m.frozen_bytes is not None and m.frozen_params else self.param_bytes

    @property
    def reduce_bytes(self) -> int:
        return (self.precision.reduce_dtype or torch.float32).itemsize

    @property
    def label(self) -> str:
        label = f"{self.strategy.value}({self.shard_size})" if self.strategy.is_hybrid else self.strategy.value
        return label + tp_label(self.tp, sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel)


def tp_label(tp: int, *, sequence_parallel: bool, loss_parallel: bool) -> str:
    """ ", tp N" (with " (sequence parallel, loss parallel)") under tensor parallelism, "" without."""
    if tp == 1:
        return ""
    parts = [name for name, on in (("sequence parallel", sequence_parallel), ("loss parallel", loss_parallel)) if on]
    return f", tp {tp}" + (f" ({', '.join(parts)})" if parts else "")


def positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def recompute_every_of(value: Any) -> int:
    """`activation_checkpointing=` as a block period: False / None / 0: none (0), True / 1: every block,
    k >= 2: 1 block in k (blocks 0, k, 2k, ...). ValueError naming the value otherwise."""
    if value is None or isinstance(value, bool):
        return int(bool(value))
    if isinstance(value, int) and value >= 0:
        return value
    raise ValueError(
        f"activation_checkpointing={value!r} is not understood; use False / 0 (none), True / 1 (every block) "
        "or an int k >= 2 (every k-th block)"
    )


def optimizer_bytes(value: Any) -> tuple[str, float]:
    if isinstance(value, str) and value.lower() in OPTIMIZER_BYTES:
        return value.lower(), float(OPTIMIZER_BYTES[value.lower()])
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return f"{value:g} B/param", float(value)
    raise ValueError(
        f"optimizer={value!r} is not understood; use one of {sorted(OPTIMIZER_BYTES)} "
        "or the optimizer state's bytes per parameter as a number (e.g. 0 for plain SGD)"
    )


def shard_size_of(strategy: Strategy, world_size: int, shard_size: int | None) -> int:
    if strategy is Strategy.NO_SHARD:
        return 1
    if not strategy.is_hybrid:
        return world_size
    if shard_size is None:
        raise ValueError(
            f"strategy={strategy.value!r} needs shard_size= (ranks per shard group, e.g. the GPUs of one node)"
        )
    size = positive_int(shard_size, "shard_size")
    if world_size % size:
        raise ValueError(
            f"shard_size={size} must divide world_size={world_size}; use a divisor such as 1, 2 or {world_size}"
        )
    return size
