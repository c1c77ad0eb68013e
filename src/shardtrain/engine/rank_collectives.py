"""What the engine's ranks do together once launched: rank-0 printing, barriers, broadcast, reductions,
gathers and seeding, as Fabric offers them.

`Engine` inherits these; they read its `rank`, `local_rank`, `world_size` and `device`, so they work
only after `engine.launch()`. In a world of one none of them communicates.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist


class RankCollectives:
    """The collectives of a launched engine (a base of `Engine`, which provides its ranks and device)."""

    if TYPE_CHECKING:  # read-only properties of Engine

        @property
        def rank(self) -> int: ...
        @property
        def local_rank(self) -> int: ...
        @property
        def world_size(self) -> int: ...
        @property
        def device(self) -> torch.device: ...

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.rank == 0:
            print(*args, **kwargs)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    @contextlib.contextmanager
    def rank_zero_first(self, *, local: bool = False) -> Iterator[None]:
        """Rank 0 (of the world, or of each node with `local`) runs the block before the others, e.g.
        to download or tokenize a data set once and let the others read the cache."""
        first = (self.local_rank if local else self.rank) == 0
        if not first:
            self.barrier()
        yield
        if first:
            self.barrier()

    def broadcast(self, obj: Any, *, src: int = 0) -> Any:
        """Rank `src`'s `obj` (any picklable value), on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "mean") -> torch.Tensor:
        """Reduce `tensor` over all ranks ("mean", "sum", "max" or "min"); returns a new tensor."""
        ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"all_reduce(op={op!r}): use one of {list(ops)}")
        out = tensor.detach().clone().to(self.device)
        if self.world_size > 1:
            dist.all_reduce(out, op=ops[op])
        return out / self.world_size if op == "mean" else out

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack every rank's `tensor` (same shape on all ranks) along a new first dimension."""
        local = tensor.detach().to(self.device).contiguous()
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        if self.world_size > 1:
            dist.all_gather(out, local)
        else:
            out[0].copy_(local)
        return torch.stack(out)

    @staticmethod
    def seed_everything(seed: int) -> int:
        """Seed Python, NumPy and torch (all devices) with the same `seed`; call it with the same value
        on every rank so that every rank initialises the model identically."""
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        return seed
