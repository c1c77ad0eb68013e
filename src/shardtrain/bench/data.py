"""Random token batches, identical across engines: a function of (seed, rank, step) only.

All batches of a run are drawn up front on the host and moved to the device before timing starts,
so the timed steps contain no data loading.
"""

from __future__ import annotations

import torch

Batch = tuple[torch.Tensor, torch.Tensor]  # (input tokens, target tokens), both (batch, seq)


def token_batches(
    *, vocab_size: int, batch: int, seq: int, steps: int, rank: int, seed: int, device: torch.device
) -> list[Batch]:
    """`steps` batches of uniformly random tokens for `rank`; the targets are the inputs shifted by one."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    tokens = torch.randint(0, vocab_size, (steps, batch, seq + 1), generator=generator).to(device)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens.unbind(0)]
