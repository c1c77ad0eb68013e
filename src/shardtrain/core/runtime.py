"""The per-model runtime: module hooks, execution order, prefetch, and the end of backward.

Forward: the pre-forward hook unshards the unit (waiting for a prefetched all-gather), installs
its parameter views and prefetches the next unit in the order recorded during the first forward;
the post-forward hook reshards (full_shard) and registers the pre-backward hook on the outputs.
Backward: the pre-backward hook unshards again and prefetches the unit whose backward comes next;
each unit's post-backward (the backward of its view function) reduces its gradient; a callback
queued on the autograd engine finishes all reductions and publishes the sharded gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from ..strategy import Strategy
from .comm import Groups, Pending
from .unit import ShardUnit, UnitState

if TYPE_CHECKING:
    from .pinned import PinnedBuffers


class Runtime:
    def __init__(self, *, strategy: Strategy, groups: Groups, forward_prefetch: bool, backward_prefetch: bool,
                 prefetch_depth: int, cast_inputs_to: torch.dtype | None,
                 control_group: dist.ProcessGroup | None, pinned: PinnedBuffers | None = None) -> None:
        self.strategy = strategy
        self.pinned = pinned  # host buffers of the offloaded units (None: nothing offloaded)
        self.groups = groups
        self.units: list[ShardUnit] = []
        self.forward_prefetch = forward_prefetch
        self.backward_prefetch = backward_prefetch
        self.prefetch_depth = prefetch_depth
        self.cast_inputs_to = cast_inputs_to
        self.control_group = control_group  # a CPU (Gloo) group for host-side agreement
        self.sync_gradients = True
        self.in_backward = False
        self._callback_queued = False
        self._forward_order: list[ShardUnit] = []
        self._post_forward_order: list[ShardUnit] = []
        self._order_recorded = False
        self._next_forward: dict[int, list[ShardUnit]] = {}
        self._next_backward: dict[int, list[ShardUnit]] = {}
        self._last_reduce: Pending | None = None
        self._deferred: tuple[ShardUnit, torch.Tensor] | None = None

    # ------------------------------------------------------------------ hooks
    def register(self, unit: ShardUnit, module: torch.nn.Module) -> None:
        self.units.append(unit)
        module.register_forward_pre_hook(lambda m, a, k: self._pre_forward(unit, a, k), with_kwargs=True, prepend=True)
        module.register_forward_hook(lambda m, a, o: self._post_forward(unit, o))

    def _pre_forward(self, unit: ShardUnit, args, kwargs):
        if unit.index == 0 and not self.in_backward:
            for u in self.units:
                u.release_cleared_grads()
        if not self._order_recorded and not self.in_backward:
            if unit.index == 0:
                self._forward_order, self._post_forward_order = [], []
            if unit not in self._forward_order:
                self._forward_order.append(unit)
        unit.unshard()
        if self._order_recorded and self.forward_prefetch and not self.in_backward:
            for nxt in self._next_forward.get(unit.index, ()):
                nxt.unshard()
        unit.wait_unshard()
        unit.prepare_views(in_backward=self.in_backward)
        if self.cast_inputs_to is not None:
            args, kwargs = _cast_floats((args, kwargs), self.cast_inputs_to)
        return args, kwargs

    def _post_forward(self, unit: ShardUnit, output):
        if self.in_backward:
            return output  # recomputation inside backward: keep the parameters for the gradients
        if not self._order_recorded:
            if unit not in self._post_forward_order:
                self._post_forward_order.append(unit)
            if unit.index == 0:
                self._freeze_order()
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not torch.is_grad_enabled() or not tensors:
            # No backward will come for this call: release now.
            if not unit.behaviour.resident:
                unit.reshard()
                unit.forget_views()
            else:
                unit.uninstall_views()
            return output
        if unit.behaviour.reshard_after_forward:
            unit.reshard()
        elif unit.behaviour.resident:
            unit.uninstall_views()
        register_multi_grad_hook(tensors, lambda grads: self._pre_backward(unit), mode="any")
        return output

    def _freeze_order(self) -> None:
        # Note: units that never gather (sharded lookups) take no prefetch slot.
        fwd = [u for u in self._forward_order if u.gathers]
        bwd = [u for u in reversed(self._post_forward_order) if u.gathers]
        depth = self.prefetch_depth
        self._next_forward = {u.index: fwd[i + 1:i + 1 + depth] for i, u in enumerate(fwd)}
        self._next_backward = {u.index: bwd[i + 1:i + 1 + depth] for i, u in enumerate(bwd)}
        self._order_recorded = True

    def _pre_backward(self, unit: ShardUnit) -> None:
        self._issue_deferred()
        if not self._callback_queued:
            self._callback_queued = True
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        unit.unshard()
        if self.backward_prefetch and self._order_recorded:
            for nxt in self._next_backward.get(unit.index, ()):
                nxt.unshard()
        unit.wait_unshard()
        unit.prepare_views(in_backward=True)

    # ------------------------------------------------------------------ gradient reduction
    def defer_reduce(self, unit: ShardUnit, flat: torch.Tensor) -> None:
        """Issue `unit`'s reduction at the next hook, once its backward node has returned.

        Note: autograd holds a node's incoming per-parameter gradients until the node returns; issuing
        the reduce-scatter (and allocating its output) only then keeps them from coexisting, which
        matters for the root unit at the end of backward, the step's memory peak from 8B up.
        """
        self._issue_deferred()
        self._deferred = (unit, flat)

    def _issue_deferred(self) -> None:
        if self._deferred is not None:
            unit, flat = self._deferred
            self._deferred = None
            unit.issue_reduce(flat)

    def track_reduce(self, unit: ShardUnit, pending: Pending) -> None:
        """Keep at most one reduction in flight beyond the newest (bounds the gradient memory)."""
        if self._last_reduce is not None:
            self._last_reduce.wait()
        unit.pending_reduce = pending
        self._last_reduce = pending

    def _finish_reduces(self) -> None:
        for unit in self.units:
            if unit.pending_reduce is not None:
                unit.pending_reduce.wait()
                unit.pending_reduce = None
        self._last_reduce = None

    def _finish_backward(self) -> None:
        self._issue_deferred()
        self._finish_reduces()
        if self.groups.cuda and any(u.behaviour.offload for u in self.units):
            torch.cuda.current_stream().synchronize()  # the host optimizer reads the offloaded gradients
        if self.sync_gradients:
            used = self._agree_on_used()
            for unit, mask in zip(self.units, used):
                unit.publish_grads(mask)
                unit.shard_changed = unit.behaviour.resident  # the optimizer step comes next
        for unit in self.units:
            if unit.state is not UnitState.SHARDED and not unit.behaviour.resident:
                unit.reshard()
            else:
                unit.uninstall_views()
            unit.forget_views()
        self.in_backward = False
        self._callback_queued = False

    def _agree_on_used(self) -> list[list[bool]]:
        """A parameter has a gradient when it got one on any rank (as DDP's averaged gradient)."""
        flat = [u for unit in self.units for u in unit.used]
        if self.control_group is not None and dist.get_world_size(self.control_group) > 1:
            mask = torch.tensor(flat, dtype=torch.int32)
            dist.all_reduce(mask, group=self.control_group)
            flat = (mask > 0).tolist()
        out, i = [], 0
        for unit in self.units:
            n = len(unit.used)
            out.append(flat[i:i + n])
            i += n
        return out


def _cast_floats(tree, dtype: torch.dtype):
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)
