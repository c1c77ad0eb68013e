"""Embedding units that never gather their table: each rank looks up the rows it holds.

A token embedding is a language model's largest unit (at 8B: 525M parameters, 2.4 blocks), yet a
step reads only the rows of its tokens, and gathering it is the first thing a step waits for;
reducing its dense gradient, the last. An `nn.Embedding` unit sharded over several ranks therefore
runs its lookup where the rows are:

- forward: all-gather the shard group's token ids (W·N integers), look each up in this rank's rows
  (zero where another rank holds the row), and reduce-scatter the W·N rows, so that every rank gets
  its N. Exactly one rank contributes each element, so the sum is exact;
- backward: all-gather the N output gradients of every rank (W·N·D values instead of the table's
  V·D) and scatter them into this rank's rows, per source rank in the gradient's dtype and summed in
  the reduction dtype, as the reduce-scatter of every rank's dense gradient would: the same numbers
  with no V·D gradient, no exchange of it and no unsharded table.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .comm import _all_gather, _reduce_scatter
from .flat import FlatLayout
from .unit import ShardUnit, UnitBehaviour

if TYPE_CHECKING:
    from ..planning.units import UnitSpec


def looks_up_in_place(module: nn.Module) -> bool:
    """Whether `module` is a plain `nn.Embedding` lookup (its forward not replaced on the instance, e.g.
    by activation checkpointing, and none of the options that change or renormalise the table)."""
    if not isinstance(module, nn.Embedding) or type(module).forward is not nn.Embedding.forward:
        return False
    return not ("forward" in module.__dict__ or module.max_norm is not None or module.scale_grad_by_freq
                or module.sparse)


def runs_sharded_lookup(spec: UnitSpec, *, layout: FlatLayout, behaviour: UnitBehaviour) -> bool:
    """Whether the unit of `spec` looks rows up in place: it can (`UnitSpec.can_look_up`), and it is
    sharded over several ranks and neither offloaded nor kept resident."""
    return spec.can_look_up and layout.shard_world > 1 and not behaviour.offload and not behaviour.resident


class _Lookup(torch.autograd.Function):
    """Rows of `tokens` from the sharded table; its backward hands the gradient to the unit."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, tokens: torch.Tensor, unit: "LookupUnit"):  # noqa: ARG004
        out, ctx.rows = unit.look_up(tokens)
        ctx.unit = unit
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.unit.take_output_grad(grad, ctx.rows)
        return None, None, None


class LookupUnit(ShardUnit):
    """A `ShardUnit` of one `nn.Embedding` whose forward runs on the shard (module docstring).

    Its state stays SHARDED: there is nothing to gather, view or free; the runtime's hooks still
    run around it (prefetching the next unit, marking the start of backward).
    """

    gathers = False

    def __init__(self, *, module: nn.Embedding, **kwargs) -> None:
        super().__init__(**kwargs)
        self.module = module
        self.dim = module.embedding_dim
        self.padding_idx = module.padding_idx
        lo, hi = self.layout.shard_range(self.groups.shard_rank)
        self._held = max(0, min(hi, self.layout.numel) - lo)  # elements of the weight in this shard
        self._first_row = lo // self.dim
        self._lead = lo - self._first_row * self.dim  # elements of the first row held by lower ranks
        self._rows = math.ceil((self._lead + self._held) / self.dim)
        self._wire = self.behaviour.param_dtype if dist.get_backend(self.groups.shard) == "nccl" else self.shard.dtype
        module.forward = self.forward  # Note: an instance attribute; hooks run around it as before

    def unshard(self) -> None:
        return

    def prepare_views(self, *, in_backward: bool) -> None:
        return

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{self.name}: embedding indices must be int32 or int64, got {tokens.dtype}")
        if torch.is_grad_enabled() and self.any_requires_grad:
            return _Lookup.apply(self._anchor, tokens, self)
        return self.look_up(tokens)[0]

    def _table(self) -> torch.Tensor:
        """This rank's rows, [rows, dim], with zeros where a row's elements are held by another rank."""
        if self._lead == 0 and self._held == self._rows * self.dim:
            return self.shard[:self._held].view(self._rows, self.dim)  # whole rows: the shard itself
        table = self.shard.new_zeros(self._rows * self.dim)
        table[self._lead:self._lead + self._held] = self.shard[:self._held]
        return table.view(self._rows, self.dim)

    def _shard_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's row in this rank's table; ids held elsewhere (and the -1 filler) map to one past the end."""
        local = ids - self._first_row
        held = (local >= 0) & (local < self._rows)
        return torch.where(held, local, self._rows)

    def look_up(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings of `tokens` in the parameters' dtype, every rank's ids as this rank's table rows)."""
        ids = tokens.reshape(-1).to(device=self.device, dtype=torch.int64)
        n, longest = ids.numel(), self._longest_batch(ids.numel())
        if longest > n:
            ids = torch.cat([ids, ids.new_full((longest - n,), -1)])
        world = self.groups.shard_world
        every_id = ids.new_empty(world * longest)
        _all_gather(every_id, ids, group=self.groups.shard)
        rows = self._shard_rows(every_id)
        held = (rows < self._rows).unsqueeze(1)
        if self._rows:
            found = F.embedding(rows.clamp(max=self._rows - 1), self._table())
            partial = torch.where(held, found, 0).to(self._wire)
        else:  # this rank's shard is all padding
            partial = torch.zeros(rows.numel(), self.dim, dtype=self._wire, device=self.device)
        mine = partial.new_empty(longest, self.dim)
        _reduce_scatter(mine, partial, op=dist.ReduceOp.SUM, group=self.groups.shard)
        out = mine[:n].to(self.behaviour.param_dtype).view(*tokens.shape, self.dim)
        return out, rows

    def _longest_batch(self, n: int) -> int:
        """The largest token count of any rank this call (ranks may feed batches of different sizes).

        Note: agreed over the host (Gloo) group, so it never waits for the GPU."""
        group = self.runtime.control_group
        counts = torch.zeros(dist.get_world_size(group), dtype=torch.int64)
        _all_gather(counts, torch.tensor([n], dtype=torch.int64), group=group)
        return int(counts.max())

    # ------------------------------------------------------------------ backward
    def take_output_grad(self, grad: torch.Tensor, rows: torch.Tensor) -> None:
        """Turn every rank's output gradient into this rank's averaged shard gradient."""
        world = self.groups.shard_world
        longest = rows.numel() // world
        grad = grad.reshape(-1, self.dim)
        if grad.shape[0] < longest:
            grad = torch.cat([grad, grad.new_zeros(longest - grad.shape[0], self.dim)])
        every_grad = grad.new_empty(world * longest, self.dim)
        _all_gather(every_grad.view(torch.uint8), grad.contiguous().view(torch.uint8),
                                    group=self.groups.shard)
        if self.padding_idx is not None:
            rows = torch.where(rows == self.padding_idx - self._first_row, self._rows, rows)
        reduce_dtype = self.behaviour.reduce_dtype
        summed = None
        # Note: one dense backward per source rank, in the gradient's dtype, summed in the reduction
        # dtype: the values each rank's own backward and the fp32 reduction would give (bit for bit
        # on the CPU). The row past the end collects the ids held elsewhere; it is dropped.
        for source in range(world):
            part = torch.ops.aten.embedding_dense_backward(
                every_grad[source * longest:(source + 1) * longest], rows[source * longest:(source + 1) * longest],
                self._rows + 1, self._rows, False)
            summed = part.to(reduce_dtype) if summed is None else summed.add_(part)
        shard_grad = summed.view(-1)[self._lead:self._lead + self._held]
        if self._held < self.layout.shard_numel:
            shard_grad = torch.cat([shard_grad, shard_grad.new_zeros(self.layout.shard_numel - self._held)])
        shard_grad.div_(world)
        self.used[0] = True
        if not self.runtime.sync_gradients:  # no_sync: keep the shard group's average until the synchronising backward
            self._accumulated = shard_grad if self._accumulated is None else self._accumulated.add_(shard_grad)
            return
        if self._accumulated is not None:
            shard_grad.add_(self._accumulated)
            self._accumulated = None
        self.take_reduced(self.groups.average_over_replicas(shard_grad))
