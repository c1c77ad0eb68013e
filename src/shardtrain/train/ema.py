"""An exponential moving average of the weights, kept in host memory.

Each rank averages only its own rows of every parameter (the local part of what `model.parameters()`
yields after sharding), so the EMA costs 4 bytes per parameter / world size of host memory and no
communication. To evaluate it,
`swapped_in` copies the averages into the shards in place (the engine notices the change and
re-gathers), and restores the trained weights afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..core.shard_module import runtime_of
from ..core.sharded_param import local_of


class WeightEMA:
    """The average of a sharded model's trainable rows on this rank (module docstring)."""

    def __init__(self, model: nn.Module, *, decay: float) -> None:
        self.decay = decay
        self.model = model
        self.params = [local_of(p) for p in model.parameters() if p.requires_grad]
        self.averages = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        self._settle()
        current = [p.detach().to("cpu", torch.float32) for p in self.params]
        torch._foreach_lerp_(self.averages, current, 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the model's weights are the averages."""
        self._settle()
        saved = [p.detach().to("cpu", copy=True) for p in self.params]
        with torch.no_grad():
            for p, avg in zip(self.params, self.averages):
                p.copy_(avg)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, w in zip(self.params, saved):
                    p.copy_(w)

    def _settle(self) -> None:
        """Complete the offloaded units' deferred optimizer steps (Note [Overlapped host step]) before
        the rows are read: the local rows are read directly, not through an API that settles."""
        runtime_of(self.model)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "averages": self.averages}

    def load_state_dict(self, state: dict) -> None:
        if len(state["averages"]) != len(self.averages):
            raise ValueError(
                f"EMA state holds {len(state['averages'])} tensors, this model has {len(self.averages)}; "
                "resume at the same world size and model"
            )
        for avg, saved in zip(self.averages, state["averages"]):
            avg.copy_(saved)
