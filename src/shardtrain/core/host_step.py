"""The optimizer step of host-stepped units, deferred and overlapped with the GPU's work, exactly.

With CPU offload the user's optimizer steps the offloaded shards on the host. Run inside
`optimizer.step()` after backward, that host step adds its whole time to the step. `HostSteps` takes
those parameters out of the user's `step()` (their `.grad` is hidden for the call, so the optimizer
steps the others as usual) and steps them per unit on a worker thread, in the order of the next
forward; the forward's pre-hook of unit k waits for unit k's step only, so its host-to-device copy
follows right behind it while the remaining units step beside the GPU's forward
(docs/design.md, Note [Overlapped host step]).

Exactness: each unit is stepped by a shallow copy of the user's optimizer (same class, same code
path: fused, foreach or per tensor as chosen) whose param groups hold the unit's local rows as plain
tensors and the hyperparameters as they were when `step()` was called (an LR scheduler may change
them right after), and whose state entries are the local rows of the user's state tensors, updated
in place. AdamW, Adam and SGD update each element from that element alone, so stepping per unit is
bitwise the single step. Everything global (clipping's norm, the non-finite verdict, a loss scale)
is already decided when `step()` is called. Plain tensors also spare the host step DTensor's dispatch.

Other optimizers, a closure, or `differentiable=True` step in sequence as before, with one warning
per optimizer; the first step (state not yet created) runs in sequence silently. Pending steps are
completed ("flushed") before anything reads or replaces what they write: the next `step()`, the
first backward hook, `model.state_dict()` / `load_state_dict()`, the optimizer's `state_dict()` /
`load_state_dict()` / `zero_grad(set_to_none=False)`, and `runtime_of(model)` (every shardtrain API:
checkpoints, `full_state_dict`, export).
"""

from __future__ import annotations

import copy
import enum
import os
import warnings
import weakref
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .sharded_param import local_of

if TYPE_CHECKING:
    from .disk_state import DiskState
    from .runtime import Runtime
    from .unit import ShardUnit

# Optimizers whose update of an element reads that element's parameter, gradient and state only.
SPLITTABLE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
ENV = "SHARDTRAIN_HOST_STEP"


class StepMode(enum.Enum):
    OVERLAPPED = "overlapped"  # host steps deferred per unit, beside the GPU's work (the default)
    SEQUENTIAL = "sequential"  # the user's step() steps everything after backward

    @classmethod
    def from_env(cls) -> StepMode:
        value = os.environ.get(ENV, cls.OVERLAPPED.value)
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{ENV}={value!r}: use 'overlapped' or 'sequential'") from None


@dataclass(frozen=True, kw_only=True)
class _UnitStep:
    """One unit's deferred step: the optimizer view that steps it and the gradients it reads."""

    unit: ShardUnit
    view: torch.optim.Optimizer
    grads: list[tuple[torch.Tensor, torch.Tensor]]  # (local parameter alias, local gradient)


@dataclass(kw_only=True)
class _Held:
    """What `step()`'s pre-hook took out of the user's call, for its post-hook."""

    optimizer: torch.optim.Optimizer
    grads: list[tuple[nn.Parameter, torch.Tensor]]
    groups: list[dict[str, Any]]  # each param group's hyperparameters at the call
    amp: dict[str, torch.Tensor]  # grad_scale / found_inf a GradScaler handed a fused optimizer


_LIVE: weakref.WeakSet[HostSteps] = weakref.WeakSet()
_hooks_installed = False


class HostSteps:
    """The deferred per-unit optimizer steps of one sharded model's host-stepped `units`."""

    def __init__(self, *, runtime: Runtime, units: list[ShardUnit]) -> None:
        self.runtime = runtime
        self.units = units
        self._unit_of = {id(p): unit for unit in units for p in unit.params}
        self._pending: dict[int, Future] = {}  # unit.index -> its step on the worker
        self._held: _Held | None = None
        self._adopted: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._warned: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.store: DiskState | None = None  # the disk tier (core/disk_state.py): state streamed from files
        self._worker = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="shardtrain-host-step",
            initializer=_init_worker,
            initargs=(torch.get_num_threads(), runtime.comm.device),
        )
        weakref.finalize(self, self._worker.shutdown, wait=True)

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

    # ------------------------------------------------------------------ the user's step()
    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._held is not None:  # the previous step() raised before its post-hook: give the gradients back
            for p, grad in self._held.grads:
                p.grad = grad
            self._held = None
        mine = [p for g in optimizer.param_groups for p in g["params"] if id(p) in self._unit_of and p.grad is not None]
        if not mine:
            return
        self.flush()
        reason = _unsplittable(optimizer, args, kwargs)
        if reason is not None:
            if optimizer not in self._warned:
                self._warned.add(optimizer)
                warnings.warn(
                    f"shardtrain: {type(optimizer).__name__} cannot be stepped per unit ({reason}); its "
                    f"host-stepped parameters step after backward, in sequence (set {ENV}=sequential to "
                    "silence this)",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return
        # the disk tier's unit steps create the state per unit, straight into its files
        if any(not optimizer.state.get(p) for p in mine) and self.store is None:
            return  # the first step creates the state: the user's step does it, in sequence
        self._adopt(optimizer)
        self._held = _Held(
            optimizer=optimizer,
            grads=[(p, p.grad) for p in mine],
            groups=[{k: _frozen(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            amp={
                name: getattr(optimizer, name).clone()
                for name in ("grad_scale", "found_inf")
                if isinstance(getattr(optimizer, name, None), torch.Tensor)
            },
        )
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
            _unit_step(unit, optimizer, per_unit[unit.index], group_of, held)
            for unit in self._step_order()
            if unit.index in per_unit
        ]
        if self.store is not None:  # the disk tier: state to the files, reads of the first units issued
            self.store.begin(optimizer, _weak_flush(self), [(task.unit, task.view) for task in tasks])
        for task in tasks:
            self._pending[task.unit.index] = self._worker.submit(self._step_unit, task)

    def _step_order(self) -> list[ShardUnit]:
        """The units in the order the next forward needs them; those it may not run last."""
        first = [u for u in self.runtime.forward_order() if u in self.units]
        return first + [u for u in self.units if u not in first]

    def _step_unit(self, task: _UnitStep) -> None:
        """On the worker: step one unit's local rows with the user's optimizer code."""
        if self.store is not None:
            self.store.fetch(task.unit)  # the disk tier: wait for the unit's state, read into a buffer
        for alias, grad in task.grads:
            alias.grad = grad
        try:
            step = type(task.view).step
            # Note: the hook-free step (Optimizer wraps step() to run hooks): the user's and shardtrain's
            # hooks belong to the user's step() call, which already ran them.
            (step.__wrapped__ if getattr(step, "hooked", False) else step)(task.view)
        finally:
            for alias, _ in task.grads:
                alias.grad = None
            if self.store is not None:
                self.store.release(task.unit)  # the disk tier: write the buffer back behind the next steps

    def _adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Flush before the optimizer's state is read or replaced, or its gradients zeroed in place."""
        if optimizer in self._adopted:
            return
        self._adopted.add(optimizer)
        flush = _weak_flush(self)
        optimizer.register_state_dict_pre_hook(lambda opt: flush())
        optimizer.register_load_state_dict_pre_hook(lambda opt, state: flush())
        zero_grad = optimizer.zero_grad

        def zero_grad_flushing(set_to_none: bool = True) -> None:
            if not set_to_none:
                flush()  # zeroing in place would zero the gradients a pending step reads
            zero_grad(set_to_none=set_to_none)

        optimizer.zero_grad = zero_grad_flushing


def _init_worker(threads: int, device: torch.device) -> None:
    """Note: intra-op threads and the current CUDA device are per thread; the worker takes the thread
    count st.shard chose for the host and this rank's device (the optimizer's capture check queries the
    current device's stream, which would otherwise open a context on GPU 0 from every rank)."""
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _unit_step(
    unit: ShardUnit,
    optimizer: torch.optim.Optimizer,
    grads: list[tuple[nn.Parameter, torch.Tensor]],
    group_of: dict[int, int],
    held: _Held,
) -> _UnitStep:
    """The optimizer view stepping `unit`: its local rows per group, the state's local rows."""
    view = copy.copy(optimizer)  # same class and defaults; hooks and groups replaced below
    view.state = defaultdict(dict)
    groups: dict[int, dict[str, Any]] = {}
    pairs = []
    for p, grad in grads:
        alias = local_of(p).detach()  # shares the rows; its .grad is the worker's alone
        j = group_of[id(p)]
        groups.setdefault(j, dict(held.groups[j], params=[]))["params"].append(alias)
        view.state[alias] = {
            k: local_of(v) if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()
        }
        pairs.append((alias, local_of(grad)))
    view.param_groups = [groups[j] for j in sorted(groups)]
    for name, value in held.amp.items():
        setattr(view, name, value)
    return _UnitStep(unit=unit, view=view, grads=pairs)


def _unsplittable(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> str | None:
    """Why `optimizer.step(*args[1:], **kwargs)` cannot be stepped per unit, or None."""
    if type(optimizer) not in SPLITTABLE:
        return f"stepping per unit is exact for {', '.join(c.__name__ for c in SPLITTABLE)} only"
    if len(args) > 1 or kwargs:
        return "step() was given a closure"
    if any(g.get("differentiable") for g in optimizer.param_groups):
        return "differentiable=True"
    return None


def _frozen(value: Any) -> Any:
    """A hyperparameter as it is now (a tensor learning rate is copied: schedulers update it in place)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _weak_flush(steps: HostSteps):
    ref = weakref.ref(steps)

    def flush(*_args) -> None:
        live = ref()
        if live is not None:
            live.flush()

    return flush


def _pre_step(optimizer, args, kwargs) -> None:
    for steps in list(_LIVE):
        steps.before_step(optimizer, args, kwargs)


def _post_step(optimizer, args, kwargs) -> None:  # noqa: ARG001 - the hook's signature
    for steps in list(_LIVE):
        steps.after_step(optimizer)


def overlap_host_steps(model: nn.Module, runtime: Runtime, units: list[ShardUnit]) -> HostSteps:
    """Defer and overlap the optimizer step of `units` of the sharded `model` (`st.shard` does this for
    the offloaded units; on a CPU device, where nothing is offloaded, the tests do it for any unit)."""
    global _hooks_installed
    steps = HostSteps(runtime=runtime, units=units)
    runtime.host_steps = steps
    _LIVE.add(steps)
    if not _hooks_installed:
        register_optimizer_step_pre_hook(_pre_step)
        register_optimizer_step_post_hook(_post_step)
        _hooks_installed = True
    flush = _weak_flush(steps)
    model.register_state_dict_pre_hook(flush)
    model.register_load_state_dict_pre_hook(flush)
    return steps
