"""A unit's communication: all-gathers and gradient reductions, asynchronous on CPU (Gloo) and CUDA (NCCL).

On CUDA each kind of collective runs on its own high-priority stream, ordered against the compute
stream with events, so the CPU never blocks. The elementwise work around them (casting the shard into
the all-gather input, the fp32 average of received gradients) runs on side streams of its own. On CPU
the Gloo work handle runs in Gloo's threads and `wait()` joins it. Both are hidden behind `Pending`,
whose `wait()` makes the results usable on the compute stream (CUDA) or on the host (CPU).

A unit gathers in one of two ways (`GatherMode`, docs/design.md): per-parameter all-gathers whose
outputs are the parameter-major unsharded buffer itself (one grouped operation on NCCL), or one flat
all-gather of the rank-major chunks followed by one copy into the parameter-major buffer (Gloo).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..options import GatherMode
from . import collectives
from .chunk_mean import mean_of_chunks


@dataclass(frozen=True, kw_only=True)
class GatherJob:
    """One all-gather: `inp` from every rank into `out`, then `then()` (a copy-out) once it landed."""

    out: torch.Tensor
    inp: torch.Tensor
    then: Callable[[], None] | None = None


@dataclass(eq=False)
class Pending:
    """An issued collective. `keep` holds tensors that must outlive it; `then` runs after it (CPU)."""

    event: torch.cuda.Event | None = None
    works: list = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)
    then: Callable[[], None] | None = None

    @property
    def waited(self) -> bool:
        """Whether `wait()` ran (or there was nothing to wait for): on CPU the result is in place."""
        return not self.works and self.event is None and self.then is None

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
            self.event = None
        if self.then is not None:
            then, self.then = self.then, None
            then()
        # Note: only now may the kept tensors be freed: the compute stream is ordered after the
        # collective (CUDA) or the collective has finished (CPU).
        self.keep.clear()


class UnitComm:
    """The groups a unit talks to: it shards over `shard`, replicates over `replicate` (hybrid, no_shard)."""

    def __init__(
        self,
        *,
        shard: dist.ProcessGroup | None,
        replicate: dist.ProcessGroup | None,
        device: torch.device,
        gather: GatherMode | None = None,
    ) -> None:
        """`gather` None: grouped on NCCL, flat on Gloo (Note [Gloo's grouped all-gather]); the
        options' `gather` (SHARDTRAIN_GATHER) overrides it for benchmarks and tests."""
        self.shard = shard
        self.replicate = replicate
        self.shard_rank = dist.get_rank(shard) if shard is not None else 0
        self.shard_world = dist.get_world_size(shard) if shard is not None else 1
        self.replicate_world = dist.get_world_size(replicate) if replicate is not None else 1
        self.device = device
        self.cuda = device.type == "cuda"
        backend = dist.get_backend(shard) if shard is not None else "gloo"
        self.gather_mode = gather or (GatherMode.GROUPED if backend == "nccl" else GatherMode.FLAT)
        self.groups_collectives = backend == "nccl"  # Note [Gloo's grouped all-gather]
        # Note: Gloo before torch 2.13 lacks ReduceOp.AVG; SUM then divide works everywhere.
        self.native_avg = backend == "nccl"
        if self.cuda:
            high = torch.cuda.Stream.priority_range()[1]  # type: ignore[call-arg]  # a static method torch's stub misses
            self.gather_stream = torch.cuda.Stream(device=device, priority=high)
            self.reduce_stream = torch.cuda.Stream(device=device, priority=high)
            # Note: the elementwise work gets streams of its own so that the next collective never
            # queues behind it, at the compute stream's priority (a higher one gains nothing:
            # BENCHMARKS.md, 'Tried and rejected').
            self.cast_stream = torch.cuda.Stream(device=device)
            self.average_stream = torch.cuda.Stream(device=device)

    @property
    def data_parallel_world(self) -> int:
        return self.shard_world * self.replicate_world

    # ------------------------------------------------------------------ all-gather
    def gather_context(self):
        """Where all-gather inputs are prepared and outputs allocated (the cast stream on CUDA)."""
        if self.cuda:
            stream = self.cast_stream
            stream.wait_stream(torch.cuda.current_stream())
            return torch.cuda.stream(stream)
        return contextlib.nullcontext()

    def all_gather(self, jobs: list[GatherJob], *, keep: list[torch.Tensor]) -> Pending:
        """Issue `jobs` as one operation over the shard group; call inside `gather_context()`.

        Several jobs are grouped (one NCCL launch); each job's `then` runs once its data landed.
        """
        thens = [job.then for job in jobs if job.then is not None]

        def copy_out() -> None:
            for then in thens:
                then()

        if not jobs:
            return self._finish_cuda(self.cast_stream, keep=keep) if self.cuda else Pending(keep=keep)
        if self.cuda:
            self.gather_stream.wait_stream(self.cast_stream)
            with torch.cuda.stream(self.gather_stream):
                self._issue_gathers(jobs, async_op=False)
                copy_out()
            return self._finish_cuda(self.gather_stream, keep=keep + [job.inp for job in jobs])
        works = self._issue_gathers(jobs, async_op=True)
        return Pending(works=works, keep=keep, then=copy_out)

    def _issue_gathers(self, jobs: list[GatherJob], *, async_op: bool) -> list:
        """One grouped operation per dtype on NCCL (a unit mixing dtypes is rare); one all-gather per
        job on Gloo.

        Note [Gloo's grouped all-gather]: ProcessGroupGloo runs a grouped all-gather as one flat
        all-gather plus copies on its own threads, and one in flight beside another all-gather of the
        same group corrupts the process's heap (torch 2.13 CPU: two asynchronous grouped all-gathers
        of four small tensors each, issued back to back, abort in malloc within a few thousand
        iterations; the same all-gathers ungrouped run clean). So Gloo never groups: its default is
        the flat gather, one all-gather per flat group, and a grouped override issues each job alone.
        """
        if not self.groups_collectives:
            ungrouped = [
                collectives.all_gather_tensor(job.out, job.inp, group=self.shard, async_op=async_op) for job in jobs
            ]
            return ungrouped if async_op else []
        by_dtype: dict[torch.dtype, list[GatherJob]] = {}
        for job in jobs:
            by_dtype.setdefault(job.inp.dtype, []).append(job)
        works: list = []
        for same in by_dtype.values():
            if len(same) == 1:
                work = collectives.all_gather_tensor(same[0].out, same[0].inp, group=self.shard, async_op=async_op)
                works += [work] if async_op else []
                continue
            with collectives.coalesced(self.shard, async_op=async_op) as grouped:
                for job in same:
                    collectives.all_gather_tensor(job.out, job.inp, group=self.shard)
            works += grouped
        return works

    # ------------------------------------------------------------------ gradient reduction
    def reduce_gradient(
        self,
        flat_grad: torch.Tensor,
        *,
        reduce_dtype: torch.dtype,
        cut: bool,
        accumulate: Callable[[torch.Tensor], None],
    ) -> Pending:
        """Average `flat_grad` over all data-parallel ranks, keep this rank's part, pass it to `accumulate`.

        `flat_grad` holds every rank's chunk, rank after rank (`cut`), or a whole gradient every rank
        keeps (not `cut`: all-reduced). Inside a shard group a cut gradient is reduce-scattered, or,
        when it is narrower than `reduce_dtype`, exchanged as it is and averaged here in
        `reduce_dtype` (`narrow_wire`); across replicas (hybrid) the shard is then all-reduced.
        `accumulate(shard_grad)` gets the averaged part in `reduce_dtype`.
        """
        if self.cuda:
            self.reduce_stream.wait_stream(torch.cuda.current_stream())
            if cut and self.narrow_wire(flat_grad.dtype, reduce_dtype):
                with torch.cuda.stream(self.reduce_stream):
                    received, _ = self._exchange(flat_grad, async_op=False)
                self.average_stream.wait_stream(self.reduce_stream)
                with torch.cuda.stream(self.average_stream):
                    accumulate(self._average_exchanged(received, reduce_dtype))
                return self._finish_cuda(self.average_stream, keep=[flat_grad, received])
            with torch.cuda.stream(self.reduce_stream):
                accumulate(self._reduce_average(flat_grad, reduce_dtype, cut=cut))
            return self._finish_cuda(self.reduce_stream, keep=[flat_grad])
        if self.data_parallel_world == 1:
            accumulate(flat_grad.to(reduce_dtype))
            return Pending()
        if cut and self.narrow_wire(flat_grad.dtype, reduce_dtype):
            received, work = self._exchange(flat_grad, async_op=True)

            def finish_exchange() -> None:  # the exchange has landed
                accumulate(self._average_exchanged(received, reduce_dtype))

            return Pending(works=[work], keep=[flat_grad, received], then=finish_exchange)
        inp = flat_grad.to(reduce_dtype)
        out = self._shard_output(inp) if cut else inp
        works = self._reduce_into(out, inp, async_op=True, cut=cut)

        def finish() -> None:
            for w in works[1:]:
                w.wait()
            self._finish_average(out)
            accumulate(out)

        return Pending(works=works[:1], keep=[inp], then=finish)

    def narrow_wire(self, grad_dtype: torch.dtype, reduce_dtype: torch.dtype) -> bool:
        """Whether gradients in `grad_dtype` travel as they are and are averaged in `reduce_dtype` on arrival.

        Note: a bf16 gradient widened to fp32 is exact, so exchanging the bf16 values and adding them in
        fp32 gives the fp32 reduction at half the bytes (bit-identical to it on two ranks, where the sum
        is one addition); accumulated gradients are wider than bf16 and take the fp32 reduce-scatter.
        """
        return self.shard_world > 1 and grad_dtype.itemsize < reduce_dtype.itemsize

    def _exchange(self, flat_grad: torch.Tensor, *, async_op: bool):
        """All-to-all: rank r receives every rank's r-th chunk of `flat_grad` (as raw bytes)."""
        received = torch.empty_like(flat_grad)
        work = collectives.all_to_all_tensor(
            received.view(torch.uint8), flat_grad.view(torch.uint8), group=self.shard, async_op=async_op
        )
        return received, work

    def _shard_output(self, inp: torch.Tensor) -> torch.Tensor:
        return (
            torch.empty(inp.numel() // self.shard_world, dtype=inp.dtype, device=inp.device)
            if self.shard_world > 1
            else inp
        )

    def _average_exchanged(self, received: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
        """Average what the exchange delivered over the shard group here (core/chunk_mean.py), then across replicas."""
        return self.average_over_replicas(mean_of_chunks(received, self.shard_world, reduce_dtype))

    def average_over_replicas(self, shard_grad: torch.Tensor) -> torch.Tensor:
        """Average over the replicas (hybrid; nothing to do otherwise), in place, a shard gradient
        already averaged over the shard group, and return it."""
        self._reduce_into(shard_grad, shard_grad, async_op=False, cut=True, replicas_only=True)
        if self.replicate_world > 1:
            shard_grad.div_(self.replicate_world)
        return shard_grad

    def _reduce_average(self, flat_grad: torch.Tensor, reduce_dtype: torch.dtype, *, cut: bool) -> torch.Tensor:
        inp = flat_grad.to(reduce_dtype)
        out = self._shard_output(inp) if cut else inp
        self._reduce_into(out, inp, async_op=False, cut=cut)
        self._finish_average(out)
        return out

    def _reduce_into(
        self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool, cut: bool, replicas_only: bool = False
    ) -> list:
        """Issue the reduction (only the replicas' all-reduce when the shard group was summed already);
        return the works not yet waited on."""
        op = dist.ReduceOp.AVG if self.native_avg and not replicas_only else dist.ReduceOp.SUM
        works = []
        if self.shard_world > 1 and not replicas_only:
            if cut:
                works.append(collectives.reduce_scatter_tensor(out, inp, op=op, group=self.shard, async_op=async_op))
            else:
                works.append(collectives.all_reduce(out, op=op, group=self.shard, async_op=async_op))
        if self.replicate_world > 1:
            if works and async_op:
                # Gloo: the all-reduce needs the first result. Note: a Gloo work must be waited once
                # only: a second wait copies its result out again, over the all-reduce's.
                works.pop().wait()
            works.append(collectives.all_reduce(out, op=op, group=self.replicate, async_op=async_op))
        return works

    def _finish_average(self, out: torch.Tensor) -> None:
        """Divide the summed gradient by the ranks it was summed over, unless NCCL's AVG did."""
        if not self.native_avg and self.data_parallel_world > 1:
            out.div_(self.data_parallel_world)

    def _finish_cuda(self, stream: torch.cuda.Stream, keep: list[torch.Tensor] | None = None) -> Pending:
        event = torch.cuda.Event()
        event.record(stream)
        return Pending(event=event, keep=keep or [])
