"""The disk tier of CPU offload: the optimizer state of host-stepped units in per-rank files, streamed.

With `st.CPUOffload(disk_dir=DIR)` the elementwise optimizer state of the offloaded units lives in one
file per rank under DIR instead of host memory; the per-unit host step (offload/host_step.py) streams
each unit's region through a bounded ring of host memory (offload/disk_pool.py), read ahead and
written behind. The user's optimizer keeps its state entries (empty storages while on disk), and the
bytes are moved, never converted: training is bitwise that of host-memory offload. The pipeline and
the state's round trips: docs/design.md, Note [Disk tier]; the file itself is offload/disk_file.py.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from ..core.sharded_param import local_of
from .aio import ALIGN, Request, aligned_empty
from .disk_file import StateFile
from .disk_layout import (
    Piece,
    Region,
    aliases,
    elementwise,
    empty_like,
    evict,
    layout,
    on_disk,
    predicted_bytes,
    restore,
)
from .disk_pool import BufferRing

if TYPE_CHECKING:
    from ..core.unit import ShardUnit

DEFAULT_SLOTS = 4  # pool size when no budget is given, in the largest unit's regions (smaller ones: more)


class DiskState:
    """One optimizer's state in the per-rank file: its units' regions and the slot pool the unit steps
    stream through."""

    def __init__(self, *, directory: str, rank: int, buffer_bytes: int | None, threads: int = 8) -> None:
        self.buffer_bytes = buffer_bytes
        self.file = StateFile(directory=directory, rank=rank, threads=threads)
        self._optimizer: weakref.ref[torch.optim.Optimizer] | None = None
        self._regions: dict[int, Region] = {}  # unit index -> its region
        self._pool: BufferRing | None = None
        self._queue: deque[int] = deque()  # units to read ahead, in step order
        self._reads: dict[int, tuple[torch.Tensor, Request]] = {}
        self._writes: list[Request] = []
        # unit -> (a state dict of its view, key, the entry's piece of the region, the entry's shape)
        self._views: dict[int, list[tuple[dict, str, Piece, torch.Size]]] = {}
        self._held: dict[int, torch.Tensor] = {}  # unit -> its slot while it steps
        self._fresh: dict[int, tuple[Any, list]] = {}  # unit -> (view, [(parameter, alias)]) on its first step
        self._ready = threading.Condition()

    @property
    def direct(self) -> bool:
        """Whether the file is read and written with O_DIRECT."""
        return self.file.direct

    # ------------------------------------------------------------------ sizes
    def file_bytes(self) -> int:
        """Bytes of the file given to unit regions (introspection: tests and benchmarks read it)."""
        return self.file.end

    def slot_count(self) -> int:
        """How many of the largest unit's regions the pool holds at once (introspection: tests read it)."""
        return self._pool.nbytes // self._largest() if self._pool is not None else 0

    def pool_bytes(self) -> int:
        """Bytes of the ring of host buffers the units stream through (introspection: tests read it)."""
        return self._pool.nbytes if self._pool is not None else 0

    def _largest(self) -> int:
        return max([ALIGN, *(r.nbytes for r in self._regions.values())])

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """The pool's first `nbytes`, for a transfer outside the step's pipeline (the pool is idle)."""
        self._size_pool()
        assert self._pool is not None and not self._pool.lent, "the disk tier's pool is in use"
        return self._pool.buffer[:nbytes]

    # ------------------------------------------------------------------ one step (main thread)
    def begin(self, optimizer: torch.optim.Optimizer, tasks: list[tuple[ShardUnit, Any]]) -> None:
        """Before the deferred steps of `tasks` ((unit, optimizer view), in step order) are submitted:
        write what is resident to the files, point the views at slots on fetch, start the reads."""
        self._bind(optimizer)
        self.drain()
        entries = {unit.index: self._entries(optimizer, unit) for unit, _ in tasks}
        fresh = {  # the state is not created yet
            unit.index
            for unit, _ in tasks
            if unit.index not in self._regions and not any(optimizer.state.get(p) for p in unit.params)
        }
        if fresh:  # before any state exists: is there room for what the first step will create?
            self.file.check_space(
                self.file.end + sum(predicted_bytes(optimizer, u) for u, _ in tasks if u.index in fresh)
            )
        stale = [
            index
            for index, ents in entries.items()
            if index not in fresh
            and (
                index not in self._regions
                or [(p.key, p.numel, p.dtype) for p in self._regions[index].pieces]
                != [(k, t.numel(), t.dtype) for k, t in ents]
                or any(not on_disk(t) for _, t in ents)
            )
        ]
        if stale:
            self._write_resident(optimizer, {i: entries[i] for i in stale})
        self._size_pool()
        for unit, view in tasks:
            if unit.index in fresh:  # no state yet: the unit's step creates it, release() writes it
                self._fresh[unit.index] = (view, aliases(unit, view, optimizer))
                continue
            region = self._regions[unit.index]
            by_tensor = {id(t): piece for (_, t), piece in zip(entries[unit.index], region.pieces)}
            swaps = []
            for state in view.state.values():
                for key, value in state.items():
                    piece = by_tensor.get(id(value))
                    if piece is not None:
                        swaps.append((state, key, piece, value.shape))
            self._views[unit.index] = swaps
            self._queue.append(unit.index)
        with self._ready:
            self._pump()

    def _entries(self, optimizer: torch.optim.Optimizer, unit: ShardUnit) -> list[tuple[tuple[int, str], torch.Tensor]]:
        """The unit's elementwise state tensors (local rows shaped like the parameter's), in a fixed order."""
        out = []
        for p in unit.params:
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                if elementwise(state[key], p):
                    out.append(((id(p), key), local_of(state[key])))
        return out

    def _write_resident(self, optimizer: torch.optim.Optimizer, stale: dict[int, list]) -> None:
        """(Re)lay out the `stale` units' regions and write their state, then empty the tensors."""
        self.materialize(list(stale))  # entries still on disk under an old layout come back first
        layouts = {index: layout(ents) for index, ents in stale.items()}
        end = self.file.end
        regions = {}
        for index, (pieces, nbytes) in layouts.items():
            old = self._regions.get(index)
            offset = old.offset if old is not None and nbytes <= old.nbytes else end
            end += nbytes if offset == end else 0
            regions[index] = Region(offset=offset, nbytes=nbytes, pieces=pieces)
        self.file.reserve(end)
        self._regions.update(regions)
        for index, ents in stale.items():
            region = self._regions[index]
            slot = self._scratch(region.nbytes)
            for (_, tensor), piece in zip(ents, region.pieces):
                region.piece_view(slot, piece, tensor.shape).copy_(tensor)
            self.file.wait(self.file.write(region.offset, slot[: region.nbytes]))
            for _, tensor in ents:
                evict(tensor)

    def _size_pool(self) -> None:
        """The ring: `buffer_bytes`, else `DEFAULT_SLOTS` x the largest region (resized while idle)."""
        largest = self._largest()
        budget = self.buffer_bytes if self.buffer_bytes is not None else DEFAULT_SLOTS * largest
        if budget < largest:
            raise ValueError(
                f"CPUOffload(disk_buffer_bytes={budget}): the largest unit's optimizer state needs a "
                f"{largest}-byte buffer; give at least {largest} (3 or more times that overlaps reads, "
                "steps and writes)"
            )
        if self._pool is None or self._pool.nbytes < budget // ALIGN * ALIGN:
            self._pool = BufferRing(budget)

    # ------------------------------------------------------------------ the pipeline (worker and I/O threads)
    def _pump(self) -> None:
        """Under `_ready`: issue the reads of queued units, in order, while the ring has room for them."""
        assert self._pool is not None
        while self._queue:
            region = self._regions[self._queue[0]]
            slot = self._pool.take(region.nbytes)
            if slot is None:
                return
            self._reads[self._queue.popleft()] = (slot, self.file.read(region.offset, slot))
            self._ready.notify_all()

    def _slot_done(self, slot: torch.Tensor) -> None:
        with self._ready:
            assert self._pool is not None
            self._pool.give(slot)
            self._pump()

    def fetch(self, unit: ShardUnit) -> None:
        """On the step worker, before `unit` steps: wait for its read; its view now steps the slot."""
        if unit.index in self._fresh:
            return
        with self._ready:
            while unit.index not in self._reads:
                self._ready.wait()
            slot, request = self._reads.pop(unit.index)
        self.file.wait(request)
        region = self._regions[unit.index]
        for state, key, piece, shape in self._views.pop(unit.index):
            state[key] = region.piece_view(slot, piece, shape)
        self._held[unit.index] = slot

    def release(self, unit: ShardUnit) -> None:
        """On the step worker, after `unit` stepped: write its slot back; the slot frees when written."""
        if unit.index in self._fresh:
            self._write_created(unit.index, *self._fresh.pop(unit.index))
            return
        slot = self._held.pop(unit.index)
        region = self._regions[unit.index]
        request = self.file.write(region.offset, slot[: region.nbytes])
        with self._ready:
            self._writes.append(request)
        request.add_done_callback(lambda r: self._slot_done(slot))

    def _write_created(self, index: int, view: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A unit's first step created its state in the view: write it to a new region (waiting, so at
        most one unit's new state is in host memory) and give the user's optimizer empty-storage entries."""
        optimizer = self._bound_optimizer()
        assert optimizer is not None, "the disk tier steps units only for the optimizer bound in begin()"
        entries = [
            ((id(p), key), view.state[alias][key])
            for p, alias in pairs
            for key in sorted(view.state.get(alias, {}))
            if elementwise(view.state[alias][key], alias)
        ]
        pieces, nbytes = layout(entries)
        region = Region(offset=self.file.end, nbytes=nbytes, pieces=pieces)
        self.file.reserve(self.file.end + nbytes)
        buffer = aligned_empty(nbytes)
        for (_, tensor), piece in zip(entries, pieces):
            region.piece_view(buffer, piece, tensor.shape).copy_(tensor)
        self.file.wait(self.file.write(region.offset, buffer))
        self._regions[index] = region
        for p, alias in pairs:
            optimizer.state[p] = {
                key: empty_like(p, value) if elementwise(value, alias) else value
                for key, value in view.state.get(alias, {}).items()
            }

    # ------------------------------------------------------------------ completion (main thread)
    def drain(self) -> None:
        """Wait for every write in flight; re-raise the first failure (ENOSPC as one line)."""
        with self._ready:
            writes, self._writes = self._writes, []
        for request in writes:
            self.file.wait(request)

    def materialize(self, units: list[int] | None = None) -> None:
        """Read the state of `units` (default: all) back into the optimizer's tensors, in host memory."""
        optimizer = self._bound_optimizer()
        if optimizer is None:
            return
        self.drain()
        by_key = {
            (id(p), key): local_of(value)
            for p, state in optimizer.state.items()
            for key, value in state.items()
            if isinstance(value, torch.Tensor)
        }
        for index in self._regions if units is None else units:
            region = self._regions.get(index)
            if region is None:
                continue
            targets = [(t, piece) for piece in region.pieces if (t := by_key.get(piece.key)) is not None and on_disk(t)]
            if not targets:
                continue
            slot = self._scratch(region.nbytes)
            self.file.wait(self.file.read(region.offset, slot[: region.nbytes]))
            for tensor, piece in targets:
                restore(tensor, region.piece_view(slot, piece, tensor.shape))

    def _bound_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer the first step bound, while it lives (None before that)."""
        return self._optimizer() if self._optimizer is not None else None

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the state in the file is `optimizer`'s (the one the first step bound)."""
        return self._bound_optimizer() is optimizer

    def _bind(self, optimizer: torch.optim.Optimizer) -> None:
        """The first step: the state in the file is `optimizer`'s from now on (HostSteps hooks it, so its
        `state_dict()` reads the state back first and `load_state_dict()` waits for the writes)."""
        if self._optimizer is not None:
            if self._optimizer() is not optimizer:
                raise ValueError(
                    f"CPUOffload(disk_dir={self.file.directory!r}): a second optimizer "
                    f"({type(optimizer).__name__}) steps the offloaded units; the disk tier keeps the state "
                    "of one optimizer per model: use one optimizer (param groups separate hyperparameters)"
                )
            return
        self._optimizer = weakref.ref(optimizer)

    def materialize_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the user's own `step()`: read back the state of what it steps (parameters whose
        gradient HostSteps left to it)."""
        self.materialize([i for i, u in self._units_of(optimizer) if any(p.grad is not None for p in u)])

    def _units_of(self, optimizer: torch.optim.Optimizer) -> list[tuple[int, list]]:
        """(unit index, the user's parameters with state in that region) for every region."""
        params = {id(p): p for p in optimizer.state}
        return [
            (index, [params[k] for k in {piece.key[0] for piece in region.pieces} if k in params])
            for index, region in self._regions.items()
        ]
