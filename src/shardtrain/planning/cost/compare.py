"""The same training setup under several sharding strategies, side by side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...strategy import parse_strategy
from .estimate import MemoryEstimate, estimate_memory, positive_int
from .report import format_comparison
from .sizes import parse_bytes


@dataclass(frozen=True, kw_only=True)
class StrategyComparison:
    """Estimates of one setup under several strategies; `str()` prints them side by side."""

    estimates: tuple[MemoryEstimate, ...]
    device_memory: int | None

    def __str__(self) -> str:
        return format_comparison(self)


DEFAULT_STRATEGIES = ("full_shard", "shard_grad_op", "optimizer_only", "no_shard", "hybrid_shard")


def default_shard_size(world_size: int) -> int:
    """For hybrid_shard: the largest divisor of world_size up to 8 (one node) below world_size."""
    return max((d for d in range(1, min(8, world_size - 1) + 1) if world_size % d == 0), default=1)


def compare_strategies(
    model_or_spec: Any = None,
    /,
    *,
    world_size: int,
    strategies: tuple[str, ...] | list[str] | None = None,
    shard_size: int | None = None,
    device_memory: int | str | None = None,
    **kwargs: Any,
) -> StrategyComparison:
    """`estimate_memory` under each of `strategies`; print the result for a side-by-side table.

    Hybrid strategies use `shard_size` (default: see `default_shard_size`). The default strategies are
    DEFAULT_STRATEGIES, less hybrid_shard where the world has no group size between 1 and itself.
    """
    world_size = positive_int(world_size, "world_size")
    tp = kwargs.get("tp", 1)  # (checked by estimate_memory) hybrid groups form among the world / tp data-parallel ranks
    data_parallel = world_size // tp if isinstance(tp, int) and tp >= 1 else world_size
    group = default_shard_size(data_parallel) if shard_size is None else shard_size
    parsed = [parse_strategy(s) for s in (DEFAULT_STRATEGIES if strategies is None else strategies)]
    if strategies is None:
        parsed = [s for s in parsed if group > 1 or not s.is_hybrid]
    if not parsed:
        raise ValueError(f"strategies={strategies!r} is empty; name at least one, e.g. ('full_shard',)")
    estimates = tuple(
        estimate_memory(
            model_or_spec,
            world_size=world_size,
            strategy=s,
            device_memory=device_memory,
            shard_size=group if s.is_hybrid else None,
            **kwargs,
        )
        for s in parsed
    )
    return StrategyComparison(
        estimates=estimates, device_memory=None if device_memory is None else parse_bytes(device_memory)
    )
