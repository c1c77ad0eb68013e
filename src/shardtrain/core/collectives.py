"""The collectives shardtrain issues, under one set of names for every supported torch, and a way to watch them.

torch 2.13 renamed the tensor collectives (`all_gather_single`, `reduce_scatter_single`); 2.11 has only
the old names. Every module that communicates imports them from here, and `observe()` lets a caller
(the tests, a profiler) see each collective as it is issued, without patching torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One issued collective operation: its kind, the elements this rank sends, the group, and how many
    tensors it moves (several when grouped: one NCCL launch)."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_to_all" | "all_reduce"
    numel: int
    dtype: torch.dtype
    group: dist.ProcessGroup | None
    tensors: int = 1


_observers: list[Callable[[Collective], None]] = []
_grouping: list[list[Collective]] = []  # the open `coalesced` block's collectives, reported as one


@contextlib.contextmanager
def observe(callback: Callable[[Collective], None]) -> Iterator[None]:
    """Call `callback(collective)` for every collective issued inside the block (this process)."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def _notify(kind: str, tensor: torch.Tensor, group) -> None:
    if not _observers:
        return
    event = Collective(kind=kind, numel=tensor.numel(), dtype=tensor.dtype, group=group)
    if _grouping:
        _grouping[-1].append(event)
        return
    _report(event)


def _report(event: Collective) -> None:
    for callback in list(_observers):
        callback(event)


def all_gather_tensor(out: torch.Tensor, inp: torch.Tensor, *, group, async_op: bool = False):
    """Every rank's `inp`, rank after rank, into `out` (`inp` may be this rank's slice of `out`)."""
    _notify("all_gather", inp, group)
    return _all_gather(out, inp, group=group, async_op=async_op)


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, *, op, group, async_op: bool = False):
    """The `op`-reduction of every rank's `inp`, of which this rank keeps chunk `rank` in `out`."""
    _notify("reduce_scatter", inp, group)
    return _reduce_scatter(out, inp, op=op, group=group, async_op=async_op)


def all_to_all_tensor(out: torch.Tensor, inp: torch.Tensor, *, group, async_op: bool = False):
    """Chunk r of every rank's `inp` to rank r, rank after rank in `out`."""
    _notify("all_to_all", inp, group)
    return dist.all_to_all_single(out, inp, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, *, op, group, async_op: bool = False):
    _notify("all_reduce", tensor, group)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


@contextlib.contextmanager
def coalesced(group, *, async_op: bool) -> Iterator[list]:
    """All-gathers (or reduce-scatters) issued inside run as one grouped operation (one NCCL group).

    With `async_op` the yielded list holds the work to wait on once the block exits.
    """
    works: list = []
    _grouping.append([])
    try:
        with dist._coalescing_manager(group, async_ops=async_op) as manager:
            yield works
    finally:
        issued = _grouping.pop()
    if issued:
        _report(
            Collective(
                kind=issued[0].kind,
                numel=sum(e.numel for e in issued),
                dtype=issued[0].dtype,
                group=group,
                tensors=len(issued),
            )
        )
    if async_op:
        works.append(manager)
