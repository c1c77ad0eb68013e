"""The disk tier's host buffers: one aligned block of bytes lent out as views in first-in first-out order.

The units' state regions differ in size (an embedding's is several times a block's), and the units
stream through in step order: each region is taken for its read, stepped in place, written back and
returned when the write completes, in the order taken (writes may finish out of order; space is reused
once everything taken before it is back). A ring of bytes holds as many regions as fit, so the budget
`CPUOffload(disk_buffer_bytes=N)` sets the read-ahead depth in bytes: with equal slots sized for the
largest region, a pool of 3 embeddings' worth held 3 block regions although it had room for 10.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .aio import ALIGN, align_up, aligned_empty


@dataclass(kw_only=True)
class _Loan:
    start: int
    end: int
    returned: bool = False


class BufferRing:
    """`nbytes` (rounded down to `ALIGN`) of aligned host memory, lent as `ALIGN`-aligned views."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = aligned_empty(nbytes // ALIGN * ALIGN)
        self._loans: deque[_Loan] = deque()  # in the order taken

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def lent(self) -> int:
        """Views taken and not yet given back."""
        return sum(not loan.returned for loan in self._loans)

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A view of `nbytes` after those lent before it, or None until enough of them are back."""
        size = align_up(nbytes)
        start = self._place(size)
        if start is None:
            return None
        self._loans.append(_Loan(start=start, end=start + size))
        return self.buffer[start : start + nbytes]

    def give(self, view: torch.Tensor) -> None:
        """Return a view `take` lent; its bytes are reused once every view taken before it is back."""
        start = view.data_ptr() - self.buffer.data_ptr()
        loan = next((loan for loan in self._loans if loan.start == start and not loan.returned), None)
        if loan is None:
            raise ValueError(f"BufferRing.give: no view at byte {start} is lent")
        loan.returned = True
        while self._loans and self._loans[0].returned:
            self._loans.popleft()

    def _place(self, size: int) -> int | None:
        """Where `size` bytes fit after the newest loan: on to the end, else from the start."""
        if not self._loans:
            return 0 if size <= self.nbytes else None
        oldest, newest = self._loans[0].start, self._loans[-1].end
        if self._loans[-1].start >= oldest:  # not wrapped: free are [newest, end) and [0, oldest)
            if newest + size <= self.nbytes:
                return newest
            return 0 if size <= oldest else None
        return newest if newest + size <= oldest else None  # wrapped: free is [newest, oldest)
