"""`st.no_sync`: micro-batches whose backward keeps gradients local (no communication)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from ..core.shard_module import runtime_of


@contextlib.contextmanager
def no_sync(model: nn.Module, *, enabled: bool = True) -> Iterator[None]:
    """Accumulate unsharded gradients locally; the first backward outside reduces the sum.

    Costs memory: each unit keeps its full gradient (in reduce dtype) until the synchronising
    backward, as with torch FSDP's no_sync.
    """
    runtime = runtime_of(model, settle=False)
    previous = runtime.sync_gradients
    runtime.sync_gradients = not enabled and previous
    try:
        yield
    finally:
        runtime.sync_gradients = previous
