"""Collectives for one unit: async all-gather and reduce-scatter on CPU (Gloo) and CUDA (NCCL).

On CUDA each kind of collective runs on its own high-priority stream, ordered against the compute
stream with events, so the CPU never blocks. The elementwise work around them (the cast into the
all-gather input, the fp32 average of received gradients) runs on side streams of its own. On CPU
the Gloo work handle runs in Gloo's threads and `wait()` joins it. Both are hidden behind `Pending`,
whose `wait()` makes the results usable on the compute stream (CUDA) or on the host (CPU).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .average import mean_of_chunks

# Note: torch 2.13 renamed the tensor collectives (*_single); 2.11 only has the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(eq=False)
class Pending:
    """An issued collective. `keep` holds tensors that must outlive it; `then` runs after it (CPU)."""

    event: torch.cuda.Event | None = None
    work: dist.Work | None = None
    keep: list[torch.Tensor] = field(default_factory=list)
    then: Callable[[], None] | None = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
            self.event = None
        if self.then is not None:
            then, self.then = self.then, None
            then()
        # Note: only now may the kept tensors be freed: the compute stream is ordered after the
        # collective (CUDA) or the collective has finished (CPU).
        self.keep.clear()


class Groups:
    """The groups one unit talks to: it shards over `shard`, replicates over `replicate` (hybrid)."""

    def __init__(self, *, shard: dist.ProcessGroup | None, replicate: dist.ProcessGroup | None,
                 device: torch.device) -> None:
        self.shard = shard
        self.replicate = replicate
        self.shard_rank = dist.get_rank(shard) if shard is not None else 0
        self.shard_world = dist.get_world_size(shard) if shard is not None else 1
        self.replicate_world = dist.get_world_size(replicate) if replicate is not None else 1
        self.device = device
        self.cuda = device.type == "cuda"
        backend = dist.get_backend(shard) if shard is not None else "gloo"
        # Note: Gloo before torch 2.13 lacks ReduceOp.AVG; SUM then divide works everywhere.
        self.native_avg = backend == "nccl"
        if self.cuda:
            high = torch.cuda.Stream.priority_range()[1]
            self.gather_stream = torch.cuda.Stream(device=device, priority=high)
            self.reduce_stream = torch.cuda.Stream(device=device, priority=high)
            # Note: the elementwise work gets streams of its own so that the next collective never
            # queues behind it; at the compute stream's priority, since on 2 x H200 raising it changed
            # nothing measurable (8B: 7,486 vs 7,503 tok/s).
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

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Pending:
        """Gather `inp` of every shard rank into `out`; call inside `gather_context()`."""
        if self.shard_world == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return self._finish_cuda(self.cast_stream) if self.cuda else Pending()
        if self.cuda:
            self.gather_stream.wait_stream(self.cast_stream)
            with torch.cuda.stream(self.gather_stream):
                _all_gather(out, inp, group=self.shard)
            return self._finish_cuda(self.gather_stream, keep=[inp])
        work = _all_gather(out, inp, group=self.shard, async_op=True)
        return Pending(work=work, keep=[inp])

    # ------------------------------------------------------------------ gradient reduction
    def reduce_gradient(self, flat_grad: torch.Tensor, *, reduce_dtype: torch.dtype,
                        accumulate: Callable[[torch.Tensor], None]) -> Pending:
        """Average `flat_grad` over all data-parallel ranks, keep this rank's shard, pass it to `accumulate`.

        Inside a shard group the gradient is reduce-scattered, or, when it is narrower than
        `reduce_dtype`, exchanged as it is and averaged here in `reduce_dtype` (`narrow_wire`); across
        replicas (hybrid) the shard is then all-reduced. `accumulate(shard_grad)` gets the averaged
        shard in `reduce_dtype`.
        """
        if self.cuda:
            self.reduce_stream.wait_stream(torch.cuda.current_stream())
            if self.narrow_wire(flat_grad.dtype, reduce_dtype):
                with torch.cuda.stream(self.reduce_stream):
                    received, _ = self._exchange(flat_grad, async_op=False)
                self.average_stream.wait_stream(self.reduce_stream)
                with torch.cuda.stream(self.average_stream):
                    accumulate(self._average_exchanged(received, reduce_dtype))
                return self._finish_cuda(self.average_stream, keep=[flat_grad, received])
            with torch.cuda.stream(self.reduce_stream):
                accumulate(self._reduce_scatter_average(flat_grad, reduce_dtype))
            return self._finish_cuda(self.reduce_stream, keep=[flat_grad])
        if self.data_parallel_world == 1:
            accumulate(flat_grad.to(reduce_dtype))
            return Pending()
        if self.narrow_wire(flat_grad.dtype, reduce_dtype):
            received, work = self._exchange(flat_grad, async_op=True)

            def finish_exchange() -> None:  # the exchange has landed
                accumulate(self._average_exchanged(received, reduce_dtype))

            return Pending(work=work, keep=[flat_grad, received], then=finish_exchange)
        inp = flat_grad.to(reduce_dtype)
        out = self._shard_output(inp)
        works = self._reduce_into(out, inp, async_op=True)

        def finish() -> None:
            for w in works[1:]:
                w.wait()
            self._finish_average(out)
            accumulate(out)

        return Pending(work=works[0], keep=[inp], then=finish)

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
        work = dist.all_to_all_single(received.view(torch.uint8), flat_grad.view(torch.uint8), group=self.shard,
                                      async_op=async_op)
        return received, work

    def _average_received(self, received: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
        """The shard group's mean of the received chunks, widened to `reduce_dtype` (core/average.py)."""
        return mean_of_chunks(received, self.shard_world, reduce_dtype)

    def _shard_output(self, inp: torch.Tensor) -> torch.Tensor:
        return torch.empty(inp.numel() // self.shard_world, dtype=inp.dtype, device=inp.device) \
            if self.shard_world > 1 else inp

    def _average_exchanged(self, received: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
        """Average what the exchange delivered over the shard group here, then across replicas."""
        return self.average_over_replicas(self._average_received(received, reduce_dtype))

    def average_over_replicas(self, shard_grad: torch.Tensor) -> torch.Tensor:
        """Average over the replicas (hybrid; nothing to do otherwise), in place, a shard gradient
        already averaged over the shard group, and return it."""
        self._reduce_into(shard_grad, shard_grad, async_op=False, replicas_only=True)
        self._finish_average(shard_grad, over_replicas=True)
        return shard_grad

    def _reduce_scatter_average(self, flat_grad: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
        inp = flat_grad.to(reduce_dtype)
        out = self._shard_output(inp)
        self._reduce_into(out, inp, async_op=False)
        self._finish_average(out)
        return out

    def _reduce_into(self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool,
                     replicas_only: bool = False) -> list:
        """Issue the reduction (only the replicas' all-reduce when the shard group was summed already);
        return the works not yet waited on."""
        op = dist.ReduceOp.AVG if self.native_avg and not replicas_only else dist.ReduceOp.SUM
        works = []
        if self.shard_world > 1 and not replicas_only:
            works.append(_reduce_scatter(out, inp, op=op, group=self.shard, async_op=async_op))
        if self.replicate_world > 1:
            if works and async_op:
                # Gloo: the all-reduce needs the reduce-scatter's result. Note: a Gloo work must be
                # waited once only: a second wait copies its result out again, over the all-reduce's.
                works.pop().wait()
            works.append(dist.all_reduce(out, op=op, group=self.replicate, async_op=async_op))
        return works

    def _finish_average(self, out: torch.Tensor, *, over_replicas: bool = False) -> None:
        """Divide the summed gradient by the ranks it was summed over, unless NCCL's AVG did.

        `over_replicas`: the shard group was averaged on arrival, only the replicas' sum is left.
        """
        if over_replicas:
            if self.replicate_world > 1:
                out.div_(self.replicate_world)
        elif not self.native_avg and self.data_parallel_world > 1:
            out.div_(self.data_parallel_world)

    def _finish_cuda(self, stream: torch.cuda.Stream, keep: list[torch.Tensor] | None = None) -> Pending:
        event = torch.cuda.Event()
        event.record(stream)
        return Pending(event=event, keep=keep or [])

