"""Which block of a parameter's global tensor each rank of a (dp, tp) mesh holds, as rows x columns.

Tensor parallelism splits a parameter along rows (`Shard(0)`, "rows"), along columns (`Shard(1)`,
"cols"), or not at all (None); the engine then cuts each rank's TP-local tensor along rows over dp.
Every cut is torch's: `ceil(n / parts)` per part, the last parts shorter or empty. So rank (d, t)
holds a box of the global tensor, `held_box`, and a checkpoint written at one (dp, tp) is read at
any other by intersecting boxes (checkpoint/sharded.py). A one-dimensional run is tp 1, split None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

SPLITS = ("rows", "cols")


@dataclass(frozen=True, kw_only=True)
class Box:
    """Rows `[rows[0], rows[1])` and, where `cols` is given, columns (dim 1) `[cols[0], cols[1])` of a
    tensor; the other dimensions whole. A 0-dim tensor's box is `Box(rows=(0, 1))`."""

    rows: tuple[int, int]
    cols: tuple[int, int] | None = None

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if not shape:
            return ()
        rest = list(shape[1:])
        if self.cols is not None:
            rest[0] = self.cols[1] - self.cols[0]
        return (self.rows[1] - self.rows[0], *rest)

    def cut(self, whole: torch.Tensor) -> torch.Tensor:
        """This box of `whole`, a tensor of the global shape (not 0-dim)."""
        return self.cut_cols(whole[self.rows[0] : self.rows[1]])

    def cut_cols(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows`, this box's rows taken whole along dim 1, cut to its columns."""
        return rows if self.cols is None else rows[:, self.cols[0] : self.cols[1]]

    def intersect(self, other: Box, shape: tuple[int, ...]) -> Box | None:
        """The part of this box inside `other` (None: nothing)."""
        rows = (max(self.rows[0], other.rows[0]), min(self.rows[1], other.rows[1]))
        if rows[1] <= rows[0]:
            return None
        if self.cols is None and other.cols is None:
            return Box(rows=rows)
        whole = (0, shape[1])
        mine, theirs = self.cols or whole, other.cols or whole
        cols = (max(mine[0], theirs[0]), min(mine[1], theirs[1]))
        return Box(rows=rows, cols=cols) if cols[1] > cols[0] else None


def chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """`[start, stop)` of part `index` when `n` is cut into `parts` parts of `ceil(n / parts)`."""
    per = -(-n // parts)
    start = min(index * per, n)
    return start, min(start + per, n)


def split_of(placement: Placement) -> str | None:
    """A tp placement as a split: "rows", "cols" or None (replicated)."""
    if isinstance(placement, Replicate):
        return None
    if isinstance(placement, Shard) and placement.dim in (0, 1):
        return SPLITS[placement.dim]
    raise ValueError(f"a parameter placed {placement} on 'tp': checkpoints split parameters along dim 0 or 1 only")


def held_box(
    shape: tuple[int, ...], *, split: str | None, dp_rank: int, dp_world: int, tp_rank: int = 0, tp_world: int = 1
) -> Box:
    """The box of a parameter of global `shape` that rank (`dp_rank`, `tp_rank`) holds."""
    if not shape:
        return Box(rows=(0, 1))
    if split == "rows":
        first, stop = chunk(shape[0], tp_world, tp_rank)
        start, end = chunk(stop - first, dp_world, dp_rank)
        return Box(rows=(first + start, first + end))
    rows = chunk(shape[0], dp_world, dp_rank)
    return Box(rows=rows, cols=chunk(shape[1], tp_world, tp_rank) if split == "cols" else None)


def stores(shape: tuple[int, ...], *, split: str | None, dp_rank: int, tp_rank: int) -> bool:
    """Whether rank (`dp_rank`, `tp_rank`) writes its box: a tp-replicated parameter is written by tp
    rank 0 only, a 0-dim one (held whole everywhere) by rank (0, 0) only."""
    if not shape:
        return dp_rank == 0 and tp_rank == 0
    return split is not None or tp_rank == 0
