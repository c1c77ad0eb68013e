"""A unit that all-gathers its parameters around compute: the ordinary unit.

Lifecycle (full_shard): SHARDED -> unshard() -> GATHERING -> wait_unshard() -> UNSHARDED -> forward
-> reshard() -> SHARDED -> (pre-backward) unshard again -> backward -> reduce the gradients ->
reshard(). shard_grad_op skips the reshard after forward; no_shard and optimizer_only keep the
unsharded parameters resident and re-gather only when the optimizer has changed the shards.

Forward sees each parameter as a view of the unsharded buffer, installed in the module's instance
`__dict__` (which Python consults before `nn.Module.__getattr__`), so `_parameters` keeps the
optimizer's DTensors at all times. `_ParamViews` hands the views out once per iteration; its backward
is the unit's post-backward and runs exactly once, when every gradient of the unit is ready (tied
uses, modules called twice and activation recomputation all feed the same node).
"""

from __future__ import annotations

import enum

import torch

from .comm import Pending
from .unit import ShardUnit


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only the shards hold data
    GATHERING = "gathering"  # all-gather issued, not yet waited on
    UNSHARDED = "unsharded"  # unsharded parameters usable by compute


class _ParamViews(torch.autograd.Function):
    """Hands out the unsharded parameter views; its backward is the unit's post-backward."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, unit: GatheredUnit):
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        views = unit.cut_views()
        frozen = [v for v, s in zip(views, unit.layout.params) if not s.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward(grads)
        return None, None


class GatheredUnit(ShardUnit):
    def __init__(self, *, installs: list[tuple[dict, str, int]], **kwargs) -> None:
        super().__init__(**kwargs)
        self.state = UnitState.SHARDED
        self._installs = installs  # (module.__dict__, attribute, parameter index)
        self._views: tuple[torch.Tensor, ...] | None = None
        self._views_track_grad = False
        self._pending_gather: Pending | None = None
        self._gathered_versions: list[int] | None = None
        # Note: fused optimizers (torch._fused_adamw_) update a shard without bumping its version
        # counter, so the runtime also marks resident units changed after every synchronising backward.
        self.shard_changed = False
        self.aliased = all(buf.aliased for buf in self.buffers)

    # ------------------------------------------------------------------ the runtime's protocol
    def begin_compute(self, *, in_backward: bool) -> None:
        self.unshard()
        self.wait_unshard()
        self.prepare_views(in_backward=in_backward)

    def end_forward(self, *, backward_follows: bool) -> None:
        if not backward_follows and not self._backward_pending():  # no backward will use the views: release now
            if self.behaviour.resident:
                self.uninstall_views()
            else:
                self.reshard()
                self.forget_views()
        elif self.behaviour.reshard_after_forward:
            self.reshard()
        elif self.behaviour.resident:
            self.uninstall_views()

    def publish_grads(self, used: list[bool]) -> None:
        super().publish_grads(used)
        # the optimizer step comes next; a resident copy is re-gathered after it
        self.shard_changed = self.behaviour.resident

    def end_backward(self) -> None:
        if self.state is not UnitState.SHARDED and not self.behaviour.resident:
            self.reshard()
        else:
            self.uninstall_views()
        self.forget_views()

    # ------------------------------------------------------------------ unshard / reshard
    def _stale(self) -> bool:
        return self.shard_changed or [buf.version for buf in self.buffers] != self._gathered_versions

    def _needs_unshard(self) -> bool:
        return self.state is UnitState.SHARDED or (self.behaviour.resident and self._stale())

    def will_gather(self) -> bool:
        """Whether `unshard()` would issue a collective now (the order check announces it first)."""
        return self._needs_unshard() and not self.aliased and any(buf.world > 1 for buf in self.buffers)

    def unshard(self) -> None:
        """Issue the all-gather (asynchronously) unless the unsharded parameters are current."""
        if not self._needs_unshard():
            return
        self.shard_changed = False
        versions = [buf.version for buf in self.buffers]
        if self.aliased:
            self.state = UnitState.UNSHARDED
            self._gathered_versions = versions
            return
        keep: list[torch.Tensor] = []
        with self.comm.gather_context():
            for buf in self.buffers:
                buf.allocate()
            jobs = [job for buf in self.buffers for job in buf.gather_jobs(self.comm.gather_mode, keep)]
            self._pending_gather = self.comm.all_gather(jobs, keep=keep)
        self._gathered_versions = versions
        self.state = UnitState.GATHERING

    def wait_unshard(self) -> None:
        if self.state is UnitState.GATHERING and self._pending_gather is not None:
            self._pending_gather.wait()
            self._pending_gather = None
            self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Drop the unsharded parameters (kept when resident or aliased)."""
        self.uninstall_views()
        if self.behaviour.resident or self.aliased or self.state is UnitState.SHARDED:
            return
        self.wait_unshard()
        for buf in self.buffers:
            buf.free()
        self.state = UnitState.SHARDED

    # ------------------------------------------------------------------ views used by forward
    def cut_views(self) -> list[torch.Tensor]:
        per_group = [buf.unsharded_views() for buf in self.buffers]
        return [per_group[g][k] for g, k in self.where]

    def _backward_pending(self) -> bool:
        """Whether a forward with gradients handed out this iteration's views and no backward took them yet."""
        return self._views is not None and self._views_track_grad

    def prepare_views(self, *, in_backward: bool) -> None:
        """Create this iteration's views (once) and install them as the modules' attributes.

        Note [Views across a forward without gradients] (docs/design.md): a forward without gradients
        reuses the views a forward with gradients handed out and keeps them for its backward.
        """
        track = torch.is_grad_enabled() and self.any_requires_grad
        if self._views is None or (not in_backward and track and not self._views_track_grad):
            if track:
                views = _ParamViews.apply(self._anchor, self)
            else:
                with torch.no_grad():
                    views = tuple(self.cut_views())
            self._views = self.factory.compute_views(views, self.layout.params)
            self._views_track_grad = track
        views = self._views
        for module_dict, attr, i in self._installs:
            module_dict[attr] = views[i]

    def uninstall_views(self) -> None:
        for module_dict, attr, _ in self._installs:
            module_dict.pop(attr, None)

    def forget_views(self) -> None:
        self._views = None

    # ------------------------------------------------------------------ gradients
    def post_backward(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """All gradients of this unit are ready: reduce them (or keep them under no_sync), reshard."""
        for i, grad in enumerate(grads):
            if grad is not None:
                self.used[i] = True
        # Note: release the unsharded parameters before allocating the reduction buffers, so the
        # two never coexist (the root's are the largest of the step).
        self._views = None
        if self.behaviour.resident:
            self.uninstall_views()
        else:
            self.reshard()
        flats = []
        for g, buf in enumerate(self.buffers):
            if not buf.group.trainable:
                continue
            # In the compute dtype when it crosses the narrow wire, else in the reduction dtype (which
            # is also the dtype gradients accumulate in over micro-batches).
            dtype = buf.group.compute_dtype if self.narrow_reduce(buf, g) else self.reduce_dtype(buf)
            read_only = self.runtime.sync_gradients and g not in self._accumulated
            flats.append((g, buf.reduce_input([grads[i] for i in buf.group.trainable], dtype, may_alias=read_only)))
        self.accumulate_or_reduce(flats)
