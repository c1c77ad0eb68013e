"""A unit's gradient as autograd made it: one 1-D tensor per parameter, not yet one flat buffer.

The bf16 gradient exchange (`Groups.reduce_gradient`) sends every rank the part of each parameter's
gradient that falls into that rank's shard straight from these tensors, so no copy of the whole unit
gradient into a flat buffer is made first (at 8B that copy was 16 ms of each 550 ms step, on the
compute stream). Only this rank's own chunk is copied, into its row of the receive buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .flat import FlatLayout


@dataclass(frozen=True, eq=False)
class GradientPieces:
    parts: tuple[torch.Tensor, ...]  # per slot of `layout`, 1-D, in the flat order (zeros where none came)
    layout: FlatLayout

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def chunk(self, rank: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(offset in `rank`'s shard, 1-D view) of each parameter's overlap with that shard, in order.

        Note: every rank derives the same pieces from the same layout, which is what lets the sender's
        and the receiver's point-to-point operations pair up one to one.
        """
        for slot, part in zip(self.layout.slots, self.parts):
            piece = self.layout.local_piece(slot, rank)
            if piece.numel:
                yield piece.shard_start, part[piece.param_start:piece.param_start + piece.numel]

    def padding_start(self, rank: int) -> int:
        """Where in `rank`'s shard the padding begins (the shard size when it has none)."""
        lo, hi = self.layout.shard_range(rank)
        return min(max(self.layout.numel - lo, 0), hi - lo)
