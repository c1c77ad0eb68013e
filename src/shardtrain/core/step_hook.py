"""The one interface through which the runtime tells optimizer steps outside the user's `step()` where
an iteration is: `StepHook`, and its do-nothing default `NoStepHook`.

Core knows nothing of CPU offload. The offload package (shardtrain/offload/) steps the offloaded units
per unit beside the GPU's work and implements this hook; `st.shard` attaches it to a model with
offloaded units (`Runtime.step_hook`). Without offload the runtime calls the default, which does
nothing, so it never branches on offload state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from .unit import ShardUnit


class StepHook(Protocol):
    """The points of an iteration at which deferred optimizer steps must act."""

    def flush(self) -> None:
        """Complete every pending step (before anything reads or replaces the shards or the state)."""

    def begin_pass(self, what: str) -> None:
        """A forward or a backward begins; `what` names it for an error."""

    def wait_for(self, units: list[ShardUnit]) -> None:
        """`units` are about to be gathered: their steps must have landed."""

    def reduced(self, unit: ShardUnit) -> None:
        """The runtime issued `unit`'s gradient reductions in a synchronising backward."""

    def backward_ended(self) -> None:
        """Every reduction of a synchronising backward was waited on."""

    def allow_clipping(self, coef: torch.Tensor, total: torch.Tensor, max_norm: float) -> bool:
        """`st.clip_grad_norm_` is about to scale the gradients by `coef`: whether to scale at all."""


class NoStepHook:
    """The default: every optimizer step runs in the user's `step()`, so nothing waits or steps here."""

    def flush(self) -> None:
        pass

    def begin_pass(self, what: str) -> None:
        pass

    def wait_for(self, units: list[ShardUnit]) -> None:
        pass

    def reduced(self, unit: ShardUnit) -> None:
        pass

    def backward_ended(self) -> None:
        pass

    def allow_clipping(self, coef: torch.Tensor, total: torch.Tensor, max_norm: float) -> bool:
        return True
