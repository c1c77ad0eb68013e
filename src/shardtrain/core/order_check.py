"""Every rank must issue the same collectives in the same order; this checks it before it can hurt.

Ranks that run different units (a block skipped on one rank, an expert that got no token) issue
different collectives: with equal sizes they would exchange the wrong tensors and train silently
wrong, with unequal sizes they would hang, or abort the process from inside the backend. So before a
hook issues its collectives every rank announces them, `(what, unit)` each and the iteration, in one
small all-gather of integers on a host-side (Gloo) group of its own, and compares the answers; only
then are the collectives issued. A mismatch stops every rank at the same point, with an error that
names each rank's unit.

The exchange waits for the peers' hosts, never for the GPU: on a GPU the host runs ahead of the
queued work, so the exchange overlaps it (the hooks' host time is off the critical path).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
import torch.distributed as dist

from .collectives import all_gather_tensor


class Collective(enum.IntEnum):
    """What a rank announces it is about to issue."""

    FORWARD_GATHER = 0
    BACKWARD_GATHER = 1
    REDUCE = 2
    LOOKUP = 3
    LOOKUP_BACKWARD = 4
    END_OF_BACKWARD = 5

    def describe(self, unit: str) -> str:
        return {
            Collective.FORWARD_GATHER: f"all-gather of {unit!r} in forward",
            Collective.BACKWARD_GATHER: f"all-gather of {unit!r} in backward",
            Collective.REDUCE: f"gradient reduction of {unit!r}",
            Collective.LOOKUP: f"embedding lookup of {unit!r}",
            Collective.LOOKUP_BACKWARD: f"embedding lookup gradient of {unit!r}",
            Collective.END_OF_BACKWARD: "the end of backward (all its units done)",
        }[self]


class RanksDiverged(RuntimeError):
    """Ranks were about to issue different collectives."""


class OrderCheck:
    """Announcements of one model's collectives over `group` (a Gloo group of the same ranks)."""

    def __init__(self, *, group: dist.ProcessGroup, unit_name: Callable[[int], str], slots: int) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.ranks = dist.get_process_group_ranks(group)
        self.unit_name = unit_name
        self.slots = slots  # the most collectives one hook announces
        self.iteration = 0

    def check(self, entries: list[tuple[Collective, int]]) -> None:
        """Every rank is about to issue `entries` ((what, unit index) each); raise `RanksDiverged` unless
        every rank announced the same, in the same iteration."""
        if len(entries) > self.slots:
            raise AssertionError(f"{len(entries)} collectives announced at once, room for {self.slots}")
        fields = [self.iteration] + [v for what, unit in entries for v in (int(what), unit)]
        fields += [-1] * (1 + 2 * self.slots - len(fields))
        mine = torch.tensor(fields, dtype=torch.int64)
        everyone = torch.empty(self.world * mine.numel(), dtype=torch.int64)
        all_gather_tensor(everyone, mine, group=self.group)
        rows = everyone.view(self.world, -1)
        if not bool((rows == mine).all()):
            raise RanksDiverged(self._describe(rows))

    def _describe(self, rows: torch.Tensor) -> str:
        parts = []
        for rank, row in zip(self.ranks, rows.tolist()):
            iteration, pairs = row[0], list(zip(row[1::2], row[2::2]))
            said = [
                Collective(what).describe(self.unit_name(unit) if unit >= 0 else "")
                for what, unit in pairs
                if what >= 0
            ]
            parts.append(f"rank {rank}: {', then '.join(said) or 'nothing'} (iteration {iteration})")
        return (
            "ranks took different paths through the model: " + "; ".join(parts) + ". Every rank must run "
            "every sharding unit in the same order in each forward and backward: a unit skipped on some ranks "
            "(a condition on the data, an expert that got no token) cannot be reduced. Run it on every rank "
            "(an expert on an empty batch), or make it part of its parent's unit (leave it out of wrap)"
        )
