"""The optimizer step of host-stepped units, deferred and overlapped with the GPU's work, exactly.

With CPU offload the user's optimizer steps the offloaded shards on the host; run inside
`optimizer.step()` after backward, that host step adds its whole time to the step. `HostSteps` takes
those parameters out of the user's `step()` and steps them per unit on a worker thread, in the order
of the next forward, each unit's forward waiting for its own step only; per-unit steps are bitwise the
single step (offload/optimizer_view.py), and pending steps are flushed before anything reads what they
write. When each unit steps, what falls back to the sequential step, and the flushes: docs/design.md,
Note [Overlapped host step].
"""

from __future__ import annotations

import warnings
import weakref
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..options import HOST_STEP_ENV
from .backward_step import BackwardSteps
from .optimizer_view import UnitStep, amp_of, hyperparameters, unit_step, unsplittable
from .step_queue import StepQueue

if TYPE_CHECKING:
    from ..core.runtime import Runtime
    from ..core.unit import ShardUnit
    from .disk_state import DiskState


@dataclass(kw_only=True)
class _Held:
    """What `step()`'s pre-hook took out of the user's call, for its post-hook."""

    optimizer: torch.optim.Optimizer
    grads: list[tuple[nn.Parameter, torch.Tensor]]
    groups: list[dict[str, Any]]  # each param group's hyperparameters at the call
    amp: dict[str, torch.Tensor]  # grad_scale / found_inf a GradScaler handed a fused optimizer
    early: set[int]  # units already stepped during backward, confirmed exact


_LIVE: weakref.WeakSet[HostSteps] = weakref.WeakSet()
_hooks_installed = False


class HostSteps:
    """The deferred per-unit optimizer steps of one sharded model's host-stepped `units`."""

    def __init__(self, *, runtime: Runtime, units: list[ShardUnit], in_backward: bool = False) -> None:
        self.runtime = runtime
        self.units = units
        self.early = BackwardSteps(enabled=in_backward)
        self._unit_of = {id(p): unit for unit in units for p in unit.params}
        self._indices = {unit.index for unit in units}
        self._pending: dict[int, Future] = {}  # unit.index -> its step on the worker
        self._queue = StepQueue(device=runtime.comm.device)
        self._position: dict[int, int] = {}  # unit.index -> its place in the next forward
        self._landing: list[tuple[ShardUnit, tuple[torch.cuda.Event, ...]]] = []  # reduced, not yet stepped
        self._held: _Held | None = None
        self._adopted: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._warned: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.store: DiskState | None = None  # the disk tier (offload/disk_state.py): state streamed from files

    # ------------------------------------------------------------------ waiting
    def pending(self) -> list[ShardUnit]:
        """The units whose deferred step has not been waited for yet."""
        return [u for u in self.units if u.index in self._pending]

    def wait_for(self, units: list[ShardUnit]) -> None:
        """Return once the deferred steps of `units` are done (re-raising the worker's error)."""
        for unit in units:
            future = self._pending.pop(unit.index, None)
            if future is not None:
                future.result()

    def flush(self) -> None:
        """Complete every pending step."""
        self.wait_for(self.pending())

    def begin_pass(self, what: str) -> None:
        """A forward or backward begins: units stepped in the last backward must have been confirmed."""
        self.early.check_stepped(what)

    # ------------------------------------------------------------------ during backward
    def reduced(self, unit: ShardUnit) -> None:
        """The runtime issued `unit`'s gradient reductions in a synchronising backward."""
        if unit.index in self._indices and self.early.optimizer_now() is not None:
            comm = self.runtime.comm
            # Note: recorded right behind the reduction and its copy to the host, on the streams they run
            # on; the worker waits for these, not for the compute stream (the host runs ahead of it).
            self._landing.append((unit, _events(comm.reduce_stream, comm.average_stream) if comm.cuda else ()))
        self._step_landed()

    def backward_ended(self) -> None:
        """Every reduction of a synchronising backward was waited on."""
        self._step_landed()
        self._landing = []
        self.early.backward_ended(self.units)

    def allow_clipping(self, coef: torch.Tensor, total: torch.Tensor, max_norm: float) -> bool:
        """`st.clip_grad_norm_` is about to scale by `coef`: whether to (offload/backward_step.py decides)."""
        return self.early.allow_clipping(coef, total, max_norm)

    def _step_landed(self) -> None:
        """Queue the early step of each landing unit whose reductions the host has waited on."""
        optimizer = self.early.optimizer_now()
        waiting = []
        for unit, ready in self._landing:
            if not unit.reduces_waited():
                waiting.append((unit, ready))
            elif optimizer is not None:
                self._step_early(unit, optimizer, ready)
        self._landing = waiting

    def _step_early(self, unit: ShardUnit, optimizer: torch.optim.Optimizer, ready: tuple) -> None:
        """Queue `unit`'s step now, if every parameter `step()` would step has its final gradient here."""
        group_of = {id(p): j for j, g in enumerate(optimizer.param_groups) for p in g["params"]}
        pairs = []
        for p, grad, used in zip(unit.params, unit.reduced_grads(), unit.used):
            if not p.requires_grad or id(p) not in group_of:
                continue
            if not used or grad is None or not optimizer.state.get(p):
                return  # unused here (another rank decides), or no state yet: it steps after backward
            pairs.append((p, grad))
        if not pairs:
            return
        if self.early.groups is None:
            self.early.groups = hyperparameters(optimizer)
        self.early.record(unit, pairs)
        task = unit_step(unit, optimizer, pairs, group_of, groups=self.early.groups, amp={})
        self._submit(UnitStep(unit=unit, view=task.view, grads=task.grads, ready=ready, in_backward=True))

    # ------------------------------------------------------------------ the user's step()
    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._held is not None:  # the previous step() raised before its post-hook: give the gradients back
            for p, grad in self._held.grads:
                p.grad = grad
            self._held = None
        mine = [p for g in optimizer.param_groups for p in g["params"] if id(p) in self._unit_of and p.grad is not None]
        owner = self.early.optimizer() if self.early.optimizer is not None else None
        early = self.early.stepped if optimizer is owner else {}
        if self.early.stepped and not early and any(self._unit_of[id(p)].index in self.early.stepped for p in mine):
            self.early.check_stepped(f"another optimizer's step() ({type(optimizer).__name__})")
        if not mine and not early:
            return
        groups, amp = hyperparameters(optimizer), amp_of(optimizer)
        reason = unsplittable(optimizer, args, kwargs)
        confirmed = self.early.at_step(
            early=bool(early), mine=mine, unit_of=self._unit_of, groups=groups, amp=amp, unsplittable=reason
        )
        self.wait_for([u for u in self.pending() if u.index not in confirmed])
        if reason is not None:
            if optimizer not in self._warned:
                self._warned.add(optimizer)
                warnings.warn(
                    f"shardtrain: {type(optimizer).__name__} cannot be stepped per unit ({reason}); its "
                    f"host-stepped parameters step after backward, in sequence (set {HOST_STEP_ENV}=sequential to "
                    "silence this)",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return
        self._adopt(optimizer)
        self.early.optimizer = weakref.ref(optimizer)
        # the disk tier's unit steps create the state per unit, straight into its files
        if any(not optimizer.state.get(p) for p in mine) and self.store is None:
            return  # the first step creates the state: the user's step does it, in sequence
        grads = [(p, p.grad) for p in mine]
        self._held = _Held(optimizer=optimizer, grads=grads, groups=groups, amp=amp, early=confirmed)
        for p in mine:
            p.grad = None  # the user's step() skips parameters without a gradient

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        held = self._held
        if held is None or held.optimizer is not optimizer:
            return
        self._held = None
        for p, grad in held.grads:
            p.grad = grad
        group_of = {id(p): j for j, g in enumerate(optimizer.param_groups) for p in g["params"]}
        per_unit: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = defaultdict(list)
        for p, grad in held.grads:
            per_unit[self._unit_of[id(p)].index].append((p, grad))
        tasks = [
            unit_step(unit, optimizer, per_unit[unit.index], group_of, groups=held.groups, amp=held.amp)
            for unit in sorted(self.units, key=self._forward_position)
            if unit.index in per_unit and unit.index not in held.early
        ]
        if self.store is not None:  # the disk tier: state to the files, reads of the first units issued
            self.store.begin(optimizer, [(task.unit, task.view) for task in tasks])
        for task in tasks:
            self._submit(task)

    # ------------------------------------------------------------------ the worker
    def _submit(self, task: UnitStep) -> None:
        """Queue `task`; the worker runs, of the queued steps, the one the next forward needs first."""
        # Note: `self._step_unit` is looked up when the step runs (the benchmark and tests wrap it).
        future = self._queue.submit(self._forward_position(task.unit), lambda: self._step_unit(task))
        self._pending[task.unit.index] = future

    def _forward_position(self, unit: ShardUnit) -> int:
        """Where the next forward needs `unit` (units it may not run come last)."""
        if not self._position:
            order = [u.index for u in self.runtime.forward_order()]
            if not order:
                return len(self.units) + unit.index
            self._position = {index: i for i, index in enumerate(order)}
        return self._position.get(unit.index, len(self.units) + unit.index)

    def _step_unit(self, task: UnitStep) -> None:
        """On the worker: step one unit's local rows with the user's optimizer code (the one place every
        unit step goes through, early or after `step()`)."""
        for event in task.ready:
            event.synchronize()
        if self.store is not None:
            self.store.fetch(task.unit)  # the disk tier: wait for the unit's state, read into a buffer
        for alias, grad in task.grads:
            alias.grad = grad
        try:
            step = type(task.view).step
            # Note: the hook-free step (Optimizer wraps step() to run hooks and marks the wrapper `hooked`;
            # torch's stubs type step() as an overload, without `__wrapped__`): the user's and shardtrain's
            # hooks belong to the user's step() call, which already ran them.
            (step.__wrapped__ if getattr(step, "hooked", False) else step)(task.view)  # type: ignore[attr-defined]
        finally:
            for alias, _ in task.grads:
                alias.grad = None
            if self.store is not None:
                self.store.release(task.unit)  # the disk tier: write the buffer back behind the next steps

    def before_state_dict(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.state_dict()` reads every entry: complete the pending steps, and read the disk
        tier's state back into host memory."""
        self.flush()
        if self.store is not None and self.store.holds(optimizer):
            self.store.materialize()

    def before_load_state_dict(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.load_state_dict()` replaces every entry: complete the pending steps and the disk
        tier's writes first."""
        self.early.check_stepped("optimizer.load_state_dict()")
        self.flush()
        if self.store is not None and self.store.holds(optimizer):
            self.store.drain()

    def before_user_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After every `before_step`: the disk tier reads back the state the user's own `step()` steps."""
        if self.store is not None and self.store.holds(optimizer):
            self.store.materialize_stepped(optimizer)

    def _adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Flush before the optimizer's state is read or replaced, or its gradients zeroed in place (the
        one set of hooks on the optimizer, the disk tier's included)."""
        if optimizer in self._adopted:
            return
        self._adopted.add(optimizer)
        ref = weakref.ref(self)

        def before_read(opt) -> None:
            live = ref()
            if live is not None:
                live.before_state_dict(opt)

        def before_load(opt, state) -> None:
            live = ref()
            if live is not None:
                live.before_load_state_dict(opt)

        optimizer.register_state_dict_pre_hook(before_read)
        optimizer.register_load_state_dict_pre_hook(before_load)
        flush = _weak_flush(self)
        early = self.early
        zero_grad = optimizer.zero_grad

        def zero_grad_flushing(set_to_none: bool = True) -> None:
            early.check_stepped("zero_grad()")
            if not set_to_none:
                flush()  # zeroing in place would zero the gradients a pending step reads
            zero_grad(set_to_none=set_to_none)

        # an instance attribute in front of the method, on purpose (mypy refuses assigning to a method)
        optimizer.zero_grad = zero_grad_flushing  # type: ignore[method-assign]


def _events(*streams: torch.cuda.Stream) -> tuple[torch.cuda.Event, ...]:
    events = []
    for stream in streams:
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    return tuple(events)


def _weak_flush(steps: HostSteps):
    ref = weakref.ref(steps)

    def flush(*_args) -> None:
        live = ref()
        if live is not None:
            live.flush()

    return flush


def _pre_step(optimizer, args, kwargs) -> None:
    live = list(_LIVE)
    for steps in live:
        steps.before_step(optimizer, args, kwargs)
    for steps in live:
        steps.before_user_step(optimizer)


def _post_step(optimizer, args, kwargs) -> None:
    for steps in list(_LIVE):
        steps.after_step(optimizer)


def overlap_host_steps(
    model: nn.Module,
    runtime: Runtime,
    units: list[ShardUnit],
    *,
    in_backward: bool = False,
) -> HostSteps:
    """Defer and overlap the optimizer step of `units` of the sharded `model` (`st.shard` does this for
    the offloaded units; on a CPU device, where nothing is offloaded, the tests do it for any unit);
    `in_backward`: step them during backward where the loop allows it (CPUOffload.step_in_backward);
    the worker steps with one intra-op thread fewer than the host's (offload/step_queue.py)."""
    global _hooks_installed
    steps = HostSteps(runtime=runtime, units=units, in_backward=in_backward)
    runtime.step_hook = steps
    _LIVE.add(steps)
    if not _hooks_installed:
        register_optimizer_step_pre_hook(_pre_step)
        register_optimizer_step_post_hook(_post_step)
        _hooks_installed = True
    flush = _weak_flush(steps)
    model.register_state_dict_pre_hook(flush)
    model.register_load_state_dict_pre_hook(flush)
    return steps
