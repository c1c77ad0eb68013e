"""GradientPieces: the per-shard pieces every rank derives from the same layout tile the padded flat
gradient exactly, so the point-to-point exchange pairs up and loses nothing."""

import pytest
import torch

from shardtrain.core.flat import build_layout
from shardtrain.core.pieces import GradientPieces


def _pieces(sizes, world):
    params = [torch.empty(n) for n in sizes]
    layout = build_layout([(f"p{i}", p, ()) for i, p in enumerate(params)], world)
    parts = tuple(torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate(sizes))
    return GradientPieces(parts=parts, layout=layout)


@pytest.mark.parametrize("sizes, world", [([3, 5, 2], 4), ([7], 2), ([7], 3), ([1, 1, 1, 9, 4], 3), ([4, 4], 2)])
def test_chunks_tile_the_padded_flat_gradient(sizes, world):
    pieces = _pieces(sizes, world)
    layout = pieces.layout
    flat = torch.cat(pieces.parts)
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        rebuilt = torch.full((layout.shard_numel,), float("nan"))
        for at, piece in pieces.chunk(rank):
            assert torch.isnan(rebuilt[at:at + piece.numel()]).all()  # no overlaps
            rebuilt[at:at + piece.numel()] = piece
        pad = pieces.padding_start(rank)
        assert pad == max(0, min(layout.numel, hi) - lo)
        assert torch.equal(rebuilt[:pad], flat[lo:lo + pad])
        assert torch.isnan(rebuilt[pad:]).all()  # only padding is left uncovered


def test_pieces_are_views_not_copies():
    pieces = _pieces([3, 5, 2], 4)
    for rank in range(4):
        for _, piece in pieces.chunk(rank):
            assert any(piece.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in pieces.parts)
