"""The tensors of one `FlatGroup` on this rank: its shard, its unsharded buffer, its sharded gradient.

`param_layout.py` says where each member lies; this class owns the tensors and cuts the views: the
members' local rows in the shard (what the optimizer's DTensors hold), their whole tensors in the
unsharded buffer (what forward uses), their local rows in the sharded gradient (`.grad`), and the
all-gather jobs that fill the unsharded buffer from the shard.

The unsharded buffer is freed with `untyped_storage().resize_(0)` and refilled in place, so autograd's
saved views of it stay valid; the all-gathers write through a second tensor on the same storage
(`_target`), so the version counter autograd checks on the saved views does not move. A group that
nothing cuts and nothing casts (world size 1, same dtype, on the device) is *aliased*: its shard is
its unsharded buffer and nothing is gathered.
"""

from __future__ import annotations

from typing import cast

import torch

from .comm import GatherJob, GatherMode
from .param_layout import FlatGroup, ParamShard


class FlatBuffers:
    def __init__(
        self,
        *,
        group: FlatGroup,
        members: list[ParamShard],
        shard: torch.Tensor,
        device: torch.device,
        rank: int,
        world: int,
        offload: bool,
    ) -> None:
        self.group = group
        self.members = members
        self.shard = shard
        self.device = device
        self.world = world if group.sharded else 1
        self.rank = rank if group.sharded else 0
        self.offload = offload
        self.aliased = self.world == 1 and group.compute_dtype == group.dtype and not offload
        self.grad: torch.Tensor | None = None  # [grad_numel] in the stored dtype, once a gradient arrived
        if self.aliased:
            self._unsharded = self._target = shard
        else:
            self._unsharded = torch.empty(group.unsharded_numel, dtype=group.compute_dtype, device=device)
            self._target = torch.empty(0, dtype=group.compute_dtype, device=device).set_(  # type: ignore[call-overload]
                self._unsharded.untyped_storage(), 0, self._unsharded.shape
            )
            self.free()

    # ------------------------------------------------------------------ views
    def local_rows(self, k: int) -> torch.Tensor:
        """Member `k`'s local rows in the shard, padding rows included."""
        m, start = self.members[k], self.group.shard_offsets[k]
        return (
            self.shard[start : start + m.local_numel].view(m.local_rows, *m.shape[1:])
            if m.shape
            else self.shard[start : start + 1].view(())
        )

    def held(self, k: int) -> torch.Tensor:
        """Member `k`'s real rows in the shard (what this rank's DTensor holds)."""
        m = self.members[k]
        if not m.shape:
            return self.local_rows(k)
        start, stop = m.held_rows(self.rank)
        return self.local_rows(k)[: stop - start]

    def unsharded_views(self) -> list[torch.Tensor]:
        """Every member whole, in its original shape, cut from the unsharded buffer."""
        views = []
        for m, start in zip(self.members, self.group.unsharded_offsets):
            views.append(self._unsharded[start : start + m.numel].view(m.shape))
        return views

    def grad_views(self) -> list[torch.Tensor]:
        """Each trainable member's real rows in the sharded gradient (in `group.trainable` order)."""
        grad = cast(torch.Tensor, self.grad)  # called only while the gradient exists
        views = []
        for index, start in zip(self.group.trainable, self.group.grad_offsets):
            m = self.members[self.group.members.index(index)]
            if not m.shape:
                views.append(grad[start : start + 1].view(()))
                continue
            rows = m.held_shape(self.rank)
            views.append(grad[start : start + rows[0] * m.row_numel].view(rows))
        return views

    # ------------------------------------------------------------------ unshard / free
    @property
    def version(self) -> int:
        return self.shard._version

    def allocate(self) -> None:
        if self.aliased:
            return
        storage = self._unsharded.untyped_storage()
        nbytes = self._unsharded.numel() * self._unsharded.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def free(self) -> None:
        if not self.aliased:
            self._unsharded.untyped_storage().resize_(0)

    def gather_jobs(self, mode: GatherMode, keep: list[torch.Tensor]) -> list[GatherJob]:
        """Prepare this rank's part (cast into place) and return the all-gathers that fill the buffer.

        Call inside the unit's gather context (the cast stream on CUDA), after `allocate()`. Tensors
        that must live until the gathers land are appended to `keep`.
        """
        if self.aliased:
            return []
        group = self.group
        shard = self._device_shard(keep)
        if self.world == 1:  # nothing to gather: the shard's layout is the unsharded buffer's
            self._target.copy_(shard, non_blocking=True)
            return []
        needs_copy = group.compute_dtype != group.dtype or self.offload
        if mode is GatherMode.FLAT:
            n = group.shard_numel
            out = torch.empty(self.world * n, dtype=group.compute_dtype, device=self.device)
            keep.append(out)
            own = out[self.rank * n : (self.rank + 1) * n]
            if needs_copy:
                own.copy_(shard)
            targets = [
                self._target[start : start + m.padded_numel].view(self.world, m.local_numel)
                for m, start in zip(self.members, group.unsharded_offsets)
            ]

            def copy_out() -> None:
                torch.split_with_sizes_copy(
                    out.view(self.world, n), [m.local_numel for m in self.members], dim=1, out=targets
                )

            return [GatherJob(out=out, inp=own if needs_copy else shard, then=copy_out)]
        jobs, dsts, srcs = [], [], []
        for m, k in zip(self.members, range(len(self.members))):
            start = group.unsharded_offsets[k]
            out = self._target[start : start + m.padded_numel]
            local = shard[group.shard_offsets[k] : group.shard_offsets[k] + m.local_numel]
            if needs_copy:
                own = out[self.rank * m.local_numel : (self.rank + 1) * m.local_numel]
                dsts.append(own)
                srcs.append(local)
                local = own
            jobs.append(GatherJob(out=out, inp=local))
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return jobs

    def _device_shard(self, keep: list[torch.Tensor]) -> torch.Tensor:
        """The shard on the compute device (one host-to-device copy when it is offloaded)."""
        if self.shard.device == self.device:
            return self.shard
        staged = self.shard.to(self.device, non_blocking=True)
        keep.append(staged)
        return staged

    # ------------------------------------------------------------------ gradients
    def reduce_input(self, grads: list[torch.Tensor | None], dtype: torch.dtype, *, may_alias: bool) -> torch.Tensor:
        """The trainable members' gradients as one flat tensor in `dtype`, rank-major: chunk r (this
        group's gradient layout) is what rank r keeps. A missing gradient counts as zeros.

        `may_alias`: the result is only read, so one unpadded gradient is returned as it is, uncopied.
        """
        members = [self.members[self.group.members.index(i)] for i in self.group.trainable]
        tensors = [
            g if g is not None else torch.zeros(m.shape, dtype=self.group.compute_dtype, device=self.device)
            for g, m in zip(grads, members)
        ]
        if may_alias and len(tensors) == 1 and tensors[0].dtype == dtype and members[0].padded_rows == members[0].rows:
            return tensors[0].reshape(-1)  # one unpadded parameter is rank-major already: no copy
        out = torch.empty(self.world * self.group.grad_numel, dtype=dtype, device=self.device)
        if self.world == 1:
            torch.cat([t.reshape(-1) for t in tensors], out=out)
        elif all(t.dtype == dtype for t in tensors):
            torch._chunk_cat(tensors, dim=0, num_chunks=self.world, out=out.view(self.world, -1))
        else:
            chunks = [_pad_rows(t, m.padded_rows).view(self.world, -1) for t, m in zip(tensors, members)]
            torch.cat(chunks, dim=1, out=out.view(self.world, -1))
        return out


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with zero rows appended up to `rows` (itself when it has them)."""
    if tensor.shape[0] == rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
