"""Arithmetic on sets of time intervals: union, difference, total length.

A set is a sorted list of disjoint half-open (start, end) pairs; `union` normalises any list of
pairs into one. The profile breakdown is built from these: e.g. exposed communication is the
length of (communication kernels − compute kernels).
"""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge overlapping or touching intervals; empty ones are dropped."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def difference(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The parts of `a` not covered by `b`."""
    cut = union(b)
    out: list[Interval] = []
    j = 0
    for start, end in union(a):
        while j < len(cut) and cut[j][1] <= start:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < end:
            if cut[k][0] > start:
                out.append((start, cut[k][0]))
            start = max(start, cut[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


def total(intervals: Iterable[Interval]) -> float:
    """Length of the union of `intervals` (overlaps counted once)."""
    return sum(end - start for start, end in union(intervals))
