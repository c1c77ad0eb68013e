"""The few host-side agreements a save or load needs, safe against one rank failing.

Every step that may fail on some ranks only (a full disk, a corrupt file, a bad value) runs through
`on_rank0` or `everyone`: the outcome is exchanged and, if any rank failed, every rank raises (a
failing rank its own exception, the others an error naming the lowest failing rank), so no rank is
left waiting in a collective for a peer that gave up. Without a process group everything runs
locally. Within a loop of collectives a rank keeps its first error in a `FirstError` until the loop
ends: docs/design.md, Note [Errors inside a loop of collectives].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class Comm:
    group: Any  # a ProcessGroup, or None without torch.distributed
    rank: int
    world: int

    @staticmethod
    def over(group) -> Comm:
        """Talk over `group` (None: the default group, or a single process without one)."""
        if not (dist.is_available() and dist.is_initialized()):
            return Comm(group=None, rank=0, world=1)
        group = group or dist.group.WORLD
        return Comm(group=group, rank=dist.get_rank(group), world=dist.get_world_size(group))

    def _broadcast(self, value: Any) -> Any:
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _all_gather(self, value: Any) -> list[Any]:
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on rank 0 only; every rank returns its result or raises its error."""
        mine = _attempt(fn) if self.rank == 0 else None
        shared = self._broadcast(_shareable(mine) if mine is not None else None)
        if mine is not None and mine[0] == "error":
            raise mine[1]
        return _settle(shared, rank=0)

    def everyone(self, fn: Callable[[], Any], *, gather: bool = False) -> Any:
        """Run `fn` on every rank and return its result (with `gather`, all ranks' results, in rank
        order); if any rank failed, raise on every rank."""
        mine = _attempt(fn)
        shared = _shareable(mine) if gather or mine[0] == "error" else ("ok", None)
        outcomes = self._all_gather(shared)
        if mine[0] == "error":
            raise mine[1]
        for rank, outcome in enumerate(outcomes):
            _settle(outcome, rank=rank)
        return [outcome[1] for outcome in outcomes] if gather else mine[1]


class FirstError:
    """The first exception of a rank's local work inside a loop of collectives, raised after the
    loop (docs/design.md, Note [Errors inside a loop of collectives])."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def run(self, fn: Callable[[], Any], *, fallback: Callable[[], Any] | None = None) -> Any:
        """`fn()`; once it or an earlier call failed, `fallback()` (or None) instead."""
        if self.error is None:
            try:
                return fn()
            except Exception as exc:
                self.error = exc
        return fallback() if fallback is not None else None

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def _attempt(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as exc:
        return "error", exc


def _shareable(outcome: tuple[str, Any]) -> tuple[str, Any]:
    """The outcome as other ranks receive it: an error travels as (is a ValueError, message)."""
    kind, value = outcome
    if kind == "ok":
        return outcome
    return kind, (isinstance(value, ValueError), f"{type(value).__name__}: {value}")


def _settle(outcome: tuple[str, Any], *, rank: int) -> Any:
    kind, value = outcome
    if kind == "ok":
        return value
    is_value_error, text = value
    raise (ValueError if is_value_error else RuntimeError)(f"rank {rank} failed: {text}")
