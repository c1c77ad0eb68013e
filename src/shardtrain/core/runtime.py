"""The per-model runtime: module hooks, execution order, prefetch, and the end of backward.

An iteration moves the runtime through `TrainingState` (IDLE -> FORWARD -> BACKWARD -> IDLE); its
hooks gather, prefetch in the recorded order, reshard and reduce each unit, and the callback queued at
the start of backward finishes the reductions. Every hook runs outside `torch.compile`d regions, so
compiled blocks see their parameters as plain inputs. Which hook does what: docs/design.md, Note
[Runtime states and hooks]; why outside compile: docs/design.md, torch.compile.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from ..strategy import Strategy
from .collectives import all_reduce
from .comm import Pending, UnitComm
from .gathered import GatheredUnit
from .order_check import Collective, OrderCheck
from .step_hook import NoStepHook, StepHook
from .unit import HostBuffers, ShardUnit


class TrainingState(enum.Enum):
    IDLE = "idle"  # between iterations (or after a forward without gradients)
    FORWARD = "forward"  # units' forwards are running
    BACKWARD = "backward"  # backward has started; the end-of-backward callback is queued


class Runtime:
    def __init__(
        self,
        *,
        strategy: Strategy,
        comm: UnitComm,
        prefetch: int,
        cast_inputs_to: torch.dtype | None,
        control_group: dist.ProcessGroup | None,
        order_group: dist.ProcessGroup | None,
        pinned: HostBuffers | None = None,
    ) -> None:
        self.strategy = strategy
        self.pinned = pinned  # host buffers of the offloaded units (None: nothing offloaded)
        self.comm = comm
        self.units: list[ShardUnit] = []
        self._modules: list[torch.nn.Module] = []  # each unit's module, as registered
        self.prefetch = prefetch  # units gathered ahead of the one computing, in forward and in backward
        self.cast_inputs_to = cast_inputs_to
        self.control_group = control_group  # a CPU (Gloo) group for host-side agreement
        self.sync_gradients = True
        self.state = TrainingState.IDLE
        self._forward_order: list[ShardUnit] = []
        self._post_forward_order: list[ShardUnit] = []
        self._order_recorded = False
        self._next_forward: dict[int, list[GatheredUnit]] = {}
        self._next_backward: dict[int, list[GatheredUnit]] = {}
        self._last_reduce: Pending | None = None
        self._deferred: tuple[ShardUnit, list] | None = None
        # optimizer steps deferred out of the user's step() (the offload package attaches its own)
        self.step_hook: StepHook = NoStepHook()
        # None: nothing to compare (one rank, or the options' check_order False)
        self.order = (
            OrderCheck(group=order_group, unit_name=lambda i: self.units[i].label, slots=2 + prefetch)
            if order_group is not None
            else None
        )

    @property
    def root(self) -> ShardUnit:
        return self.units[0]

    # ------------------------------------------------------------------ hooks
    def register(self, unit: ShardUnit, module: torch.nn.Module) -> None:
        self.units.append(unit)
        self._modules.append(module)
        module.register_forward_pre_hook(lambda m, a, k: self._pre_forward(unit, a, k), with_kwargs=True, prepend=True)
        module.register_forward_hook(lambda m, a, o: self._post_forward(unit, o))

    def forward_order(self) -> list[ShardUnit]:
        """The units in the order the first forward ran them (empty before it ran)."""
        return list(self._forward_order) if self._order_recorded else []

    def settle(self) -> None:
        """Complete the deferred optimizer steps, if any (before the shards are read or replaced)."""
        self.step_hook.flush()

    def _begin_iteration(self) -> None:
        """The first unit of a new forward runs: free gradients the user cleared since the last step."""
        if self.root.factory.tp is not None:
            self._refuse_compiled_units()
        self.state = TrainingState.FORWARD
        self.step_hook.begin_pass("the next forward")
        if self.order is not None:
            self.order.iteration += 1
        for u in self.units:
            u.release_cleared_grads()
        if not self._order_recorded:
            self._forward_order, self._post_forward_order = [], []

    def _refuse_compiled_units(self) -> None:
        """A compiled unit of a tensor-parallel model (`module.compile()`, or `torch.compile(module)` put
        back into its parent) fails deep in backward, inside DTensor's redistribution of a gradient the
        compiled graph returns as a plain tensor: say so first."""
        wrapped = {
            id(m._orig_mod): "torch.compile(module) in its parent"
            for m in self._modules[0].modules()
            if isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
        }
        for unit, module in zip(self.units, self._modules):
            how = (
                "module.compile()"
                if getattr(module, "_compiled_call_impl", None) is not None
                else wrapped.get(id(module))
            )
            if how is not None:
                raise ValueError(
                    f"unit {unit.label} ({type(module).__name__}) is compiled ({how}) in a "
                    "tensor-parallel model: compiling with tensor parallelism is not supported yet; run its "
                    "units eagerly, or shard without a 'tp' mesh dimension to compile them"
                )

    @torch._dynamo.disable
    def _pre_forward(self, unit: ShardUnit, args, kwargs):
        in_backward = self.state is TrainingState.BACKWARD
        if self.state is TrainingState.IDLE:
            self._begin_iteration()
        if not self._order_recorded and not in_backward and unit not in self._forward_order:
            self._forward_order.append(unit)
        ahead = self._next_forward.get(unit.index, []) if self._order_recorded and not in_backward else []
        self.step_hook.wait_for([unit, *ahead])  # their optimizer steps land before their shards are read
        entries = self._gathers([unit, *ahead])
        if not unit.gathers:
            entries.append((Collective.LOOKUP, unit.index))  # its forward exchanges ids and rows
        self._check(entries)
        for u in (unit, *ahead):
            if isinstance(u, GatheredUnit):
                u.unshard()
        unit.begin_compute(in_backward=in_backward)
        if self.cast_inputs_to is not None:
            args, kwargs = _cast_floats((args, kwargs), self.cast_inputs_to)
        return args, kwargs

    @torch._dynamo.disable
    def _post_forward(self, unit: ShardUnit, output):
        if self.state is TrainingState.BACKWARD:
            return output  # recomputation inside backward: keep the parameters for the gradients
        if not self._order_recorded:
            if unit not in self._post_forward_order:
                self._post_forward_order.append(unit)
            if unit is self.root:
                self._freeze_order()
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        backward_follows = torch.is_grad_enabled() and bool(tensors)
        unit.end_forward(backward_follows=backward_follows)
        if backward_follows:
            register_multi_grad_hook(tensors, lambda grads: self._pre_backward(unit), mode="any")
        elif unit is self.root:
            self.state = TrainingState.IDLE
        return output

    def _freeze_order(self) -> None:
        # Note: units that never gather (sharded lookups) take no prefetch slot.
        fwd = [u for u in self._forward_order if isinstance(u, GatheredUnit)]
        bwd = [u for u in reversed(self._post_forward_order) if isinstance(u, GatheredUnit)]
        depth = self.prefetch
        self._next_forward = {u.index: fwd[i + 1 : i + 1 + depth] for i, u in enumerate(fwd)}
        self._next_backward = {u.index: bwd[i + 1 : i + 1 + depth] for i, u in enumerate(bwd)}
        self._order_recorded = True

    @torch._dynamo.disable
    def _pre_backward(self, unit: ShardUnit) -> None:
        if self.state is not TrainingState.BACKWARD:
            self.state = TrainingState.BACKWARD
            self.step_hook.begin_pass("another backward")
            self.settle()  # a unit the forward skipped steps now, before gradients land again
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        ahead = self._next_backward.get(unit.index, []) if self._order_recorded else []
        self._check(self._deferred_entry() + self._gathers([unit, *ahead]))
        self._issue_deferred()
        for u in (unit, *ahead):
            if isinstance(u, GatheredUnit):
                u.unshard()
        unit.begin_compute(in_backward=True)

    # ------------------------------------------------------------------ gradient reduction
    def defer_reduce(self, unit: ShardUnit, flats: list) -> None:
        """Issue `unit`'s reductions at the next hook, once its backward node has returned.

        Note: autograd holds a node's incoming per-parameter gradients until the node returns; issuing
        the reduce-scatter (and allocating its output) only then keeps them from coexisting, which
        matters for the root unit at the end of backward, the step's memory peak from 8B up.
        """
        self._check(self._deferred_entry())
        self._issue_deferred()
        self._deferred = (unit, flats)

    def _issue_deferred(self) -> None:
        if self._deferred is not None:
            unit, flats = self._deferred
            self._deferred = None
            unit.issue_reduce(flats)
            self.step_hook.reduced(unit)  # may step it during the rest of backward

    # ------------------------------------------------------------------ order of collectives
    def _check(self, entries: list[tuple[Collective, int]]) -> None:
        """Every rank is about to issue `entries`; raise unless all announce the same (core/order_check.py)."""
        if self.order is not None and entries:
            self.order.check(entries)

    def check_one(self, what: Collective, unit: ShardUnit) -> None:
        self._check([(what, unit.index)])

    def _deferred_entry(self) -> list[tuple[Collective, int]]:
        return [(Collective.REDUCE, self._deferred[0].index)] if self._deferred is not None else []

    def _gathers(self, units: list[ShardUnit]) -> list[tuple[Collective, int]]:
        phase = Collective.BACKWARD_GATHER if self.state is TrainingState.BACKWARD else Collective.FORWARD_GATHER
        return [(phase, u.index) for u in units if isinstance(u, GatheredUnit) and u.will_gather()]

    def track_reduce(self, unit: ShardUnit, pending: Pending) -> None:
        """Keep at most one reduction in flight beyond the newest (bounds the gradient memory)."""
        if self._last_reduce is not None:
            self._last_reduce.wait()
        unit.track(pending)
        self._last_reduce = pending

    def _finish_reduces(self) -> None:
        for unit in self.units:
            unit.wait_reduces()
        self._last_reduce = None

    @torch._dynamo.disable
    def _finish_backward(self) -> None:
        self._check(self._deferred_entry() + [(Collective.END_OF_BACKWARD, -1)])
        self._issue_deferred()
        self._finish_reduces()
        if self.comm.cuda and any(u.behaviour.offload for u in self.units):
            torch.cuda.current_stream().synchronize()  # the host optimizer reads the offloaded gradients
        if self.sync_gradients:
            self.step_hook.backward_ended()
            used = self._agree_on_used()
            for unit, mask in zip(self.units, used):
                unit.publish_grads(mask)
        for unit in self.units:
            unit.end_backward()
        self.state = TrainingState.IDLE

    def _agree_on_used(self) -> list[list[bool]]:
        """A parameter has a gradient when it got one on any rank (as DDP's averaged gradient)."""
        flat = [u for unit in self.units for u in unit.used]
        if self.control_group is not None and dist.get_world_size(self.control_group) > 1:
            mask = torch.tensor(flat, dtype=torch.int32)
            all_reduce(mask, op=dist.ReduceOp.SUM, group=self.control_group)
            flat = (mask > 0).tolist()
        out, i = [], 0
        for unit in self.units:
            n = len(unit.used)
            out.append(flat[i : i + n])
            i += n
        return out


def _cast_floats(tree, dtype: torch.dtype):
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)
