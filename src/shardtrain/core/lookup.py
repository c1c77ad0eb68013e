"""Embedding units that never gather their table: each rank looks up the rows it holds.

A token embedding is a language model's largest unit (at 8B: 525M parameters, 2.4 blocks), yet a
step reads only the rows of its tokens, and gathering it is the first thing a step waits for;
reducing its dense gradient, the last. An `nn.Embedding` unit sharded over several ranks therefore
runs its lookup where the rows are:

- forward: all-gather the shard group's token ids (W·N integers), look each up in this rank's rows
  (zero where another rank holds the row), and reduce-scatter the W·N rows, so that every rank gets
  its N. Exactly one rank holds each row, so the sum is exact;
- backward: all-gather the N output gradients of every rank (W·N·D values instead of the table's
  V·D) and scatter them into this rank's rows, per source rank in the gradient's dtype and summed in
  the reduction dtype, as the reduce-scatter of every rank's dense gradient would: the same numbers
  with no V·D gradient, no exchange of it and no unsharded table.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .collectives import all_gather_tensor, reduce_scatter_tensor
from .order_check import Collective
from .partition import UnitSpec
from .unit import ShardUnit, UnitBehaviour


def runs_sharded_lookup(spec: UnitSpec, *, world: int, behaviour: UnitBehaviour) -> bool:
    """Whether the unit of `spec` looks rows up in place: it can (`UnitSpec.can_look_up`), and it is
    sharded over several ranks and neither offloaded nor kept resident."""
    return spec.can_look_up and world > 1 and not behaviour.offload and not behaviour.resident


class _Lookup(torch.autograd.Function):
    """Rows of `tokens` from the sharded table; its backward hands the gradient to the unit."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, tokens: torch.Tensor, unit: LookupUnit):
        out, ctx.rows = unit.look_up(tokens)
        ctx.unit = unit
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.unit.take_output_grad(grad, ctx.rows)
        return None, None, None


class LookupUnit(ShardUnit):
    """A unit of one `nn.Embedding` whose forward runs on the shard (module docstring).

    There is nothing to gather, view or free: this rank's rows of the table are its shard. The
    runtime's hooks still run around it (prefetching the next unit, marking the start of backward).
    """

    gathers = False

    def __init__(self, *, module: nn.Embedding, **kwargs) -> None:
        super().__init__(**kwargs)
        self.module = module
        self.dim = module.embedding_dim
        self.padding_idx = module.padding_idx
        shard = self.layout.params[0]
        self._rows = shard.local_rows  # this rank's rows, the padding rows at the table's end included
        self._first_row = self.comm.shard_rank * self._rows
        self._wire = shard.compute_dtype if dist.get_backend(self.comm.shard) == "nccl" else shard.dtype
        module.forward = self.forward  # type: ignore[method-assign]  # Note: an instance attribute; hooks run around it as before

    # ------------------------------------------------------------------ the runtime's protocol
    def begin_compute(self, *, in_backward: bool) -> None:
        """The table's rows are where the lookup reads them: nothing to prepare."""

    def end_forward(self, *, backward_follows: bool) -> None:
        """Nothing was gathered: nothing to release."""

    def end_backward(self) -> None:
        """Nothing was gathered: nothing to release."""

    # ------------------------------------------------------------------ forward
    @torch._dynamo.disable
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{self.label}: embedding indices must be int32 or int64, got {tokens.dtype}")
        if torch.is_grad_enabled() and self.any_requires_grad:
            return _Lookup.apply(self._anchor, tokens, self)
        return self.look_up(tokens)[0]

    def _table(self) -> torch.Tensor:
        """This rank's rows, [rows, dim], on the compute device."""
        return self.buffers[0].local_rows(0)

    def _shard_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's row in this rank's table; ids held elsewhere (and the -1 filler) map to one past the end."""
        local = ids - self._first_row
        held = (local >= 0) & (local < self._rows)
        return torch.where(held, local, self._rows)

    def look_up(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings of `tokens` in the compute dtype, every rank's ids as this rank's table rows)."""
        ids = tokens.reshape(-1).to(device=self.device, dtype=torch.int64)
        n, longest = ids.numel(), self._longest_batch(ids.numel())
        if longest > n:
            ids = torch.cat([ids, ids.new_full((longest - n,), -1)])
        world = self.comm.shard_world
        every_id = ids.new_empty(world * longest)
        all_gather_tensor(every_id, ids, group=self.comm.shard)
        rows = self._shard_rows(every_id)
        held = (rows < self._rows).unsqueeze(1)
        found = F.embedding(rows.clamp(max=self._rows - 1), self._table())
        partial = torch.where(held, found, 0).to(self._wire)
        # Note: when this rank has the longest batch the output is allocated in its final shape and the
        # reduce-scatter writes into it, so the embeddings are no view of a larger buffer: a compiled block
        # that takes them sees the same kind of input as the blocks after it (no second dynamic-shape graph).
        mine = partial.new_empty(*tokens.shape, self.dim) if n == longest else partial.new_empty(longest, self.dim)
        reduce_scatter_tensor(mine.view(longest, self.dim), partial, op=dist.ReduceOp.SUM, group=self.comm.shard)
        out = mine if n == longest else mine[:n].view(*tokens.shape, self.dim)
        return out.to(self.layout.params[0].compute_dtype), rows

    def _longest_batch(self, n: int) -> int:
        """The largest token count of any rank this call (ranks may feed batches of different sizes).

        Note: agreed over the host (Gloo) group, so it never waits for the GPU."""
        group = self.runtime.control_group
        counts = torch.zeros(dist.get_world_size(group), dtype=torch.int64)
        all_gather_tensor(counts, torch.tensor([n], dtype=torch.int64), group=group)
        return int(counts.max())

    # ------------------------------------------------------------------ backward
    def take_output_grad(self, grad: torch.Tensor, rows: torch.Tensor) -> None:
        """Turn every rank's output gradient into this rank's averaged shard gradient."""
        self.runtime.check_one(Collective.LOOKUP_BACKWARD, self)
        world = self.comm.shard_world
        longest = rows.numel() // world
        grad = grad.reshape(-1, self.dim)
        if grad.shape[0] < longest:
            grad = torch.cat([grad, grad.new_zeros(longest - grad.shape[0], self.dim)])
        every_grad = grad.new_empty(world * longest, self.dim)
        all_gather_tensor(every_grad.view(torch.uint8), grad.contiguous().view(torch.uint8), group=self.comm.shard)
        if self.padding_idx is not None:
            rows = torch.where(rows == self.padding_idx - self._first_row, self._rows, rows)
        reduce_dtype = self.reduce_dtype(self.buffers[0])
        summed = None
        # Note: one dense backward per source rank, in the gradient's dtype, summed in the reduction
        # dtype: the values each rank's own backward and the fp32 reduction would give (bit for bit
        # on the CPU). The row past the end collects the ids held elsewhere; it is dropped.
        for source in range(world):
            part = torch.ops.aten.embedding_dense_backward(
                every_grad[source * longest : (source + 1) * longest],
                rows[source * longest : (source + 1) * longest],
                self._rows + 1,
                self._rows,
                False,
            )
            summed = part.to(reduce_dtype) if summed is None else summed.add_(part)
        shard_grad = cast(torch.Tensor, summed)[: self._rows].reshape(-1).div_(world)
        self.used[0] = True
        kept = self._accumulated.pop(0, None)
        if not self.runtime.sync_gradients:  # no_sync: keep the shard group's average until the synchronising backward
            self._accumulated[0] = shard_grad if kept is None else kept.add_(shard_grad)
            return
        if kept is not None:
            shard_grad.add_(kept)
        self.take_reduced(0, self.comm.average_over_replicas(shard_grad))
