"""One sharding unit: its flat fp32 shard, its unsharded parameters, and its gradient path.

Lifecycle (full_shard): SHARDED -> unshard() -> GATHERING -> wait_unshard() -> UNSHARDED ->
forward -> reshard() -> SHARDED -> (pre-backward) unshard again -> backward -> reduce the flat
gradient -> reshard(). shard_grad_op skips the reshard after forward; no_shard and
optimizer_only keep the unsharded parameters resident and re-gather only when the optimizer has
changed the shard.

The optimizer sees `shard_params`: per original parameter, the piece of it inside this rank's shard
(a 1-D view of `shard`, possibly empty; the original shape when nothing is sharded). Their `.grad`
are views of `sharded_grad`, so an elementwise optimizer updates `shard` in place.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .comm import Groups, Pending
from .flat import FlatLayout


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only the shard holds data
    GATHERING = "gathering"  # all-gather issued, not yet waited on
    UNSHARDED = "unsharded"  # unsharded parameters usable by compute


@dataclass(frozen=True, kw_only=True)
class UnitBehaviour:
    """Per-unit switches derived from the strategy (and whether the unit is the root)."""

    reshard_after_forward: bool
    resident: bool  # unsharded parameters are never freed (no_shard, optimizer_only)
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    offload: bool = False  # shard, its gradient and the optimizer state live in pinned host memory


class _ParamViews(torch.autograd.Function):
    """Hands out the unsharded parameter views; its backward is the unit's post-backward.

    Note: one call per unit per iteration, so all uses of a parameter (tied weights, modules
    called twice, activation recomputation) feed the same node and its backward runs exactly once,
    when every gradient of the unit is ready.
    """

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, unit: "ShardUnit"):  # noqa: ARG004 - anchor links the graph
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        views = unit.cut_views()
        frozen = [v for v, slot in zip(views, unit.layout.slots) if not slot.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward(grads)
        return None, None


class ShardUnit:
    gathers = True  # whether unshard() issues an all-gather (prefetching it is worth an order slot)

    def __init__(self, *, index: int, name: str, layout: FlatLayout, shard: torch.Tensor,
                 installs: list[tuple[dict, str, int]], groups: Groups, behaviour: UnitBehaviour,
                 runtime) -> None:
        self.index = index
        self.name = name
        self.layout = layout
        self.shard = shard
        self.groups = groups
        self.behaviour = behaviour
        self.runtime = runtime
        self.state = UnitState.SHARDED
        self._installs = installs  # (module.__dict__, attribute, slot index)
        self.any_requires_grad = any(s.requires_grad for s in layout.slots)
        self.device = groups.device  # where compute runs; the shard is elsewhere when offloaded
        self._anchor = torch.empty(0, device=self.device, requires_grad=True)
        self.shard_params = self._make_shard_params()
        self.sharded_grad: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []
        self.used = [False] * len(layout.slots)
        self._views: tuple[torch.Tensor, ...] | None = None
        self._views_track_grad = False
        self._pending_gather: Pending | None = None
        self.pending_reduce: Pending | None = None
        self._accumulated: torch.Tensor | None = None  # unsharded grads kept under no_sync
        self._gathered_version = -1
        # Note: fused optimizers (torch._fused_adamw_) update the shard without bumping its version
        # counter, so the runtime also marks resident units changed after every synchronising backward.
        self.shard_changed = False
        self.aliased = layout.shard_world == 1 and behaviour.param_dtype == shard.dtype and not behaviour.offload
        if self.aliased:
            self._unsharded = shard  # Note: world size 1 without a cast: the shard *is* the parameter set
            self._gather_target = shard
        else:
            self._unsharded = torch.empty(layout.padded_numel, dtype=behaviour.param_dtype, device=self.device)
            # Note: the all-gather writes through a second tensor on the same storage, so the
            # version counter that autograd checks on the saved parameter views does not move.
            self._gather_target = torch.empty(0, dtype=self._unsharded.dtype, device=self.device).set_(
                self._unsharded.untyped_storage(), 0, self._unsharded.shape)
            self._free_storage()

    # ------------------------------------------------------------------ parameters the optimizer sees
    def _make_shard_params(self) -> list[nn.Parameter]:
        params, self._spans = [], []
        rank = self.groups.shard_rank if self.layout.shard_world > 1 else 0
        for slot in self.layout.slots:
            if self.layout.shard_world == 1:
                start, numel, shape = slot.offset, slot.numel, slot.shape
            else:
                piece = self.layout.local_piece(slot, rank)
                start, numel, shape = piece.shard_start, piece.numel, (piece.numel,)
            self._spans.append((start, numel, shape))
            params.append(nn.Parameter(self.shard[start:start + numel].view(shape), requires_grad=slot.requires_grad))
        return params

    def _adopt_grad(self, grad: torch.Tensor) -> None:
        """Make a freshly reduced shard the gradient (no copy when dtypes agree)."""
        if self.behaviour.offload:
            if self.sharded_grad is None:
                self.sharded_grad = self.runtime.pinned.empty(self.shard.shape, self.shard.dtype)
            self.sharded_grad.copy_(grad, non_blocking=True)  # on the reduce stream; waited on in the final callback
        else:
            self.sharded_grad = grad if grad.dtype == self.shard.dtype else grad.to(self.shard.dtype)
        self._grad_views = [self.sharded_grad[a:a + n].view(shape) for a, n, shape in self._spans]

    # ------------------------------------------------------------------ unshard / reshard
    def _free_storage(self) -> None:
        self._unsharded.untyped_storage().resize_(0)

    def _stale(self) -> bool:
        return self.shard_changed or self.shard._version != self._gathered_version

    def unshard(self) -> None:
        """Issue the all-gather (asynchronously) unless the unsharded parameters are current."""
        if self.state is not UnitState.SHARDED and not (self.behaviour.resident and self._stale()):
            return
        self.shard_changed = False
        if self.aliased:
            self.state = UnitState.UNSHARDED
            self._gathered_version = self.shard._version
            return
        with self.groups.gather_context():
            storage = self._unsharded.untyped_storage()
            nbytes = self._unsharded.numel() * self._unsharded.element_size()
            if storage.size() != nbytes:
                storage.resize_(nbytes)
            self._pending_gather = self.groups.all_gather(self._gather_target, self._gather_input())
        self._gathered_version = self.shard._version
        self.state = UnitState.GATHERING

    def _gather_input(self) -> torch.Tensor:
        if self.shard.dtype == self._gather_target.dtype and self.layout.shard_world > 1 and not self.behaviour.offload:
            return self.shard
        if self.groups.cuda or self.layout.shard_world == 1:
            # In place: cast straight into this rank's slot of the output.
            lo, hi = self.layout.shard_range(self.groups.shard_rank if self.layout.shard_world > 1 else 0)
            slot = self._gather_target[lo:hi]
            slot.copy_(self.shard, non_blocking=True)  # host-to-device as well when offloaded
            return slot
        return self.shard.to(self._gather_target.dtype)

    def wait_unshard(self) -> None:
        if self.state is UnitState.GATHERING:
            self._pending_gather.wait()
            self._pending_gather = None
            self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Drop the unsharded parameters (kept when resident or aliased)."""
        self.uninstall_views()
        if self.behaviour.resident or self.aliased or self.state is UnitState.SHARDED:
            return
        self.wait_unshard()
        self._free_storage()
        self.state = UnitState.SHARDED

    # ------------------------------------------------------------------ views used by forward
    def cut_views(self) -> list[torch.Tensor]:
        pieces = torch.split(self._unsharded, self.layout.split_sizes)
        return [piece.view(slot.shape) for piece, slot in zip(pieces, self.layout.slots)]

    def prepare_views(self, *, in_backward: bool) -> None:
        """Create this iteration's views (once) and install them as the modules' attributes."""
        track = torch.is_grad_enabled() and self.any_requires_grad
        if self._views is None or (not in_backward and track != self._views_track_grad):
            if track:
                self._views = _ParamViews.apply(self._anchor, self)
            else:
                with torch.no_grad():
                    self._views = tuple(self.cut_views())
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
        dtype, device = self.behaviour.param_dtype, self.device
        parts = []
        for i, (g, slot) in enumerate(zip(grads, self.layout.slots)):
            if g is None:
                parts.append(torch.zeros(slot.numel, dtype=dtype, device=device))
            else:
                self.used[i] = True
                parts.append(g.reshape(-1))
        pad = self.layout.padded_numel - self.layout.numel
        if pad:
            parts.append(torch.zeros(pad, dtype=dtype, device=device))
        # Note: release the unsharded parameters before allocating the reduction buffers, so the
        # two never coexist (the root's are the largest of the step).
        self._views = None
        if not self.behaviour.resident:
            self.reshard()
        else:
            self.uninstall_views()
        # One copy into the flat gradient: in the reduction dtype when it accumulates over micro-batches,
        # else in the parameters' dtype, which the reduction widens exactly on arrival (Groups.narrow_wire).
        read_only = self._accumulated is None and self.runtime.sync_gradients
        narrow = read_only and self.groups.narrow_wire(dtype, self.behaviour.reduce_dtype)
        flat_dtype = dtype if narrow else self.behaviour.reduce_dtype
        if read_only and len(parts) == 1 and parts[0].dtype == flat_dtype:
            flat = parts[0]  # one parameter, no padding (the embedding): reduced as autograd made it, uncopied
        else:
            flat = torch.cat(parts, out=torch.empty(self.layout.padded_numel, device=device, dtype=flat_dtype))
        if self._accumulated is not None:
            self._accumulated += flat
            flat = self._accumulated
        if self.runtime.sync_gradients:
            self._accumulated = None
            self.runtime.defer_reduce(self, flat)
        elif self._accumulated is None:
            self._accumulated = flat

    def release_cleared_grads(self) -> None:
        """Free `sharded_grad` once the user cleared every `.grad` (zero_grad(set_to_none=True)).

        Note: this keeps gradient memory out of the forward's activation peak, as torch FSDP does.
        """
        if self.behaviour.offload:
            return  # the pinned host buffer is kept: pinning is slow and host memory is not the limit
        if self.sharded_grad is not None and all(p.grad is None for p in self.shard_params):
            self.sharded_grad = None
            self._grad_views = []

    def issue_reduce(self, flat: torch.Tensor) -> None:
        """Reduce `flat` (this unit's full gradient) into the sharded gradient, asynchronously."""
        pending = self.groups.reduce_gradient(flat, reduce_dtype=self.behaviour.reduce_dtype,
                                              accumulate=self._receiver())
        self.runtime.track_reduce(self, pending)

    def take_reduced(self, shard_grad: torch.Tensor) -> None:
        """Make `shard_grad` (averaged over all ranks, in the reduction dtype) this step's gradient."""
        self._receiver()(shard_grad)

    def _receiver(self) -> Callable[[torch.Tensor], None]:
        """How a reduced shard gradient joins `.grad`, decided now, while the reduction may land later.

        Note: a fresh step adopts the reduction's output as the gradient; only accumulation (no
        zero_grad between backwards) adds into the existing one.
        """
        fresh = [p.grad is None for p in self.shard_params]
        overwrite = self.sharded_grad is None or all(fresh)
        target = self.sharded_grad
        stale = [] if overwrite else [v for v, f in zip(self._grad_views, fresh) if f]

        def accumulate(shard_grad: torch.Tensor) -> None:
            if overwrite:
                self._adopt_grad(shard_grad)
                return
            for v in stale:
                v.zero_()
            target.add_(shard_grad.to(target.device))

        return accumulate

    def owns_grads(self) -> bool:
        """Whether every gradient-carrying parameter's `.grad` is still the view into `sharded_grad`."""
        return all(p.grad is v for p, v in zip(self.shard_params, self._grad_views) if p.requires_grad)

    def publish_grads(self, used: list[bool]) -> None:
        """Point `.grad` of every parameter that got a gradient on any rank at its shard gradient."""
        if self.sharded_grad is None:
            return
        for p, v, u in zip(self.shard_params, self._grad_views, used):
            if u and p.requires_grad and p.grad is not v:
                p.grad = v
        self.used = [False] * len(self.used)
