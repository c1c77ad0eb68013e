"""Sharding strategies and the parsing of their many spellings.

A strategy decides three things for every unit: whether the fp32 parameters are sharded between
uses, whether the unsharded parameters are released after forward, and how gradients are reduced.
"""

from __future__ import annotations

import enum
from typing import Any


class Strategy(enum.Enum):
    """What is sharded across the shard group (ZeRO stage in brackets)."""

    FULL_SHARD = "full_shard"  # params, grads, optimizer state (ZeRO-3)
    SHARD_GRAD_OP = "shard_grad_op"  # grads and optimizer state; params kept through backward (ZeRO-2)
    OPTIMIZER_ONLY = "optimizer_only"  # optimizer state; full params resident (ZeRO-1)
    NO_SHARD = "no_shard"  # nothing (DDP)
    HYBRID_SHARD = "hybrid_shard"  # full_shard inside a group, replicated across groups
    HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"  # shard_grad_op inside a group, replicated across

    @property
    def reshard_after_forward(self) -> bool:
        """Whether the unsharded parameters are freed between forward and backward."""
        return self in (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD)

    @property
    def keeps_params_resident(self) -> bool:
        """Whether the unsharded parameters stay allocated across steps."""
        return self in (Strategy.NO_SHARD, Strategy.OPTIMIZER_ONLY)

    @property
    def is_hybrid(self) -> bool:
        return self in (Strategy.HYBRID_SHARD, Strategy.HYBRID_SHARD_ZERO2)


_ALIASES = {
    "full_shard": Strategy.FULL_SHARD,
    "zero3": Strategy.FULL_SHARD,
    "shard_grad_op": Strategy.SHARD_GRAD_OP,
    "zero2": Strategy.SHARD_GRAD_OP,
    "optimizer_only": Strategy.OPTIMIZER_ONLY,
    "zero1": Strategy.OPTIMIZER_ONLY,
    "no_shard": Strategy.NO_SHARD,
    "ddp": Strategy.NO_SHARD,
    "hybrid_shard": Strategy.HYBRID_SHARD,
    "hybrid_shard_zero2": Strategy.HYBRID_SHARD_ZERO2,
    "_hybrid_shard_zero2": Strategy.HYBRID_SHARD_ZERO2,
}


def parse_strategy(value: Any) -> Strategy:
    """Accept a `Strategy`, our names, torch's names, or a torch `ShardingStrategy` member."""
    if isinstance(value, Strategy):
        return value
    if isinstance(value, enum.Enum) and type(value).__name__ == "ShardingStrategy":
        value = value.name
    if isinstance(value, str):
        key = value.strip().lower()
        if key in _ALIASES:
            return _ALIASES[key]
    valid = sorted({s.value for s in Strategy})
    raise ValueError(
        f"unknown sharding strategy {value!r}; use one of {valid} "
        "(torch's FULL_SHARD / SHARD_GRAD_OP / NO_SHARD / HYBRID_SHARD and ShardingStrategy members work too)"
    )
