"""What every sharding unit has: its shards, the parameters the optimizer sees, and their gradients.

A unit's parameters live in its `FlatBuffers` (one per `FlatGroup`); `params` holds, per original
parameter, the tensor the optimizer updates (a DTensor over the rank's rows, `sharded_param.py`).
Reduced gradients arrive per group as one flat tensor (`take_reduced`); the unit cuts them into the
parameters' `.grad` and publishes them at the end of backward, when every rank agreed which
parameters got a gradient.

Two kinds of unit share this: `GatheredUnit` (gathered.py), which all-gathers its parameters around
compute, and `LookupUnit` (lookup.py), an embedding that looks rows up where they are held. The
runtime drives both through `begin_compute`, `end_forward` and `end_backward`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from .comm import Pending, UnitComm
from .flat_buffers import FlatBuffers
from .order_check import Collective
from .param_layout import UnitLayout
from .sharded_param import ParamFactory


class HostBuffers(Protocol):
    """Host memory for the offloaded units' shards and gradients (page-locked: offload/pinned.py)."""

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class UnitHost(Protocol):
    """What a unit asks of the runtime that drives it (runtime.py's `Runtime`): the units know this
    much of it and no more, so `unit`, `gathered` and `lookup` do not import the runtime."""

    pinned: HostBuffers | None  # host buffers of the offloaded units
    control_group: dist.ProcessGroup | None  # a CPU (Gloo) group for host-side agreement
    sync_gradients: bool  # False inside no_sync

    def track_reduce(self, unit: Any, pending: Pending) -> None: ...

    def defer_reduce(self, unit: Any, flats: list) -> None: ...

    def check_one(self, what: Collective, unit: Any) -> None: ...


@dataclass(frozen=True, kw_only=True)
class UnitBehaviour:
    """Per-unit switches derived from the strategy."""

    reshard_after_forward: bool
    resident: bool  # unsharded parameters are never freed (no_shard, optimizer_only)
    reduce_dtype: torch.dtype | None  # None: each group's stored dtype
    offload: bool = False  # shards, their gradients and the optimizer state live in pinned host memory


class ShardUnit(ABC):
    """The state and gradient bookkeeping common to every unit (module docstring)."""

    gathers = True  # whether the unit all-gathers its parameters (and so takes a prefetch slot)

    def __init__(
        self,
        *,
        index: int,
        name: str,
        layout: UnitLayout,
        buffers: list[FlatBuffers],
        comm: UnitComm,
        behaviour: UnitBehaviour,
        runtime: UnitHost,
        factory: ParamFactory,
    ) -> None:
        self.index = index
        self.name = name
        self.layout = layout
        self.buffers = buffers
        self.comm = comm
        self.behaviour = behaviour
        self.runtime = runtime
        self.factory = factory
        self.device = comm.device  # where compute runs; the shards are elsewhere when offloaded
        self.where: list[tuple[int, int]] = [(0, 0)] * len(layout.params)  # param -> (group, member position)
        for g, buf in enumerate(buffers):
            for k, i in enumerate(buf.group.members):
                self.where[i] = (g, k)
        self.params: list[nn.Parameter] = [
            factory.parameter(buffers[g].held(k), shard) for shard, (g, k) in zip(layout.params, self.where)
        ]
        self.any_requires_grad = any(s.requires_grad for s in layout.params)
        self._anchor = torch.empty(0, device=self.device, requires_grad=True)
        self._grads: list[torch.Tensor | None] = [None] * len(layout.params)  # what `.grad` is when published
        self.used = [False] * len(layout.params)
        self._accumulated: dict[int, torch.Tensor] = {}  # group -> unsharded gradients kept under no_sync
        self._pending_reduces: list[Pending] = []

    @property
    def label(self) -> str:
        return self.name or "<root>"

    def held(self, index: int) -> torch.Tensor:
        """This rank's real rows of parameter `index`, as a plain tensor (a view of its shard)."""
        g, k = self.where[index]
        return self.buffers[g].held(k)

    def reduce_dtype(self, buf: FlatBuffers) -> torch.dtype:
        return self.behaviour.reduce_dtype or buf.group.dtype

    # ------------------------------------------------------------------ the runtime's protocol
    @abstractmethod
    def begin_compute(self, *, in_backward: bool) -> None:
        """Make the parameters usable by the module's forward (or its recomputation in backward)."""

    @abstractmethod
    def end_forward(self, *, backward_follows: bool) -> None:
        """The module's forward returned; `backward_follows` when its outputs require gradients."""

    @abstractmethod
    def end_backward(self) -> None:
        """The whole backward is over: drop what only this iteration needed."""

    # ------------------------------------------------------------------ gradients
    def issue_reduce(self, flats: list[tuple[int, torch.Tensor]]) -> None:
        """Reduce each group's rank-major gradient `flat` into its sharded gradient, asynchronously."""
        for g, flat in flats:
            buf = self.buffers[g]
            pending = self.comm.reduce_gradient(
                flat, reduce_dtype=self.reduce_dtype(buf), cut=buf.group.sharded, accumulate=self._receiver(g)
            )
            self.runtime.track_reduce(self, pending)

    def take_reduced(self, g: int, shard_grad: torch.Tensor) -> None:
        """Make `shard_grad` (group `g`'s gradient averaged over all ranks) this step's gradient."""
        self._receiver(g)(shard_grad)

    def _receiver(self, g: int) -> Callable[[torch.Tensor], None]:
        """How group `g`'s reduced gradient joins `.grad`, decided now, while the reduction may land later.

        Note: a fresh step adopts the reduction's output as the gradient (no copy when dtypes agree);
        only accumulation (no zero_grad between backwards) adds into the existing one.
        """
        buf = self.buffers[g]
        trainable = buf.group.trainable
        fresh = [self.params[i].grad is None for i in trainable]
        overwrite = buf.grad is None or all(fresh)
        target = buf.grad
        stale = [] if overwrite else [v for v, f in zip(buf.grad_views(), fresh) if f]

        def accumulate(shard_grad: torch.Tensor) -> None:
            if overwrite:
                self._adopt(g, shard_grad)
                return
            for v in stale:
                v.zero_()
            held = cast(torch.Tensor, target)  # not overwriting: the gradient exists
            held.add_(shard_grad.to(held.device))

        return accumulate

    def _adopt(self, g: int, shard_grad: torch.Tensor) -> None:
        buf = self.buffers[g]
        if buf.offload:
            if buf.grad is None:
                buf.grad = cast(HostBuffers, self.runtime.pinned).empty((buf.group.grad_numel,), buf.group.dtype)
            buf.grad.copy_(shard_grad, non_blocking=True)  # on the reduce stream; waited on at the end of backward
        else:
            buf.grad = shard_grad if shard_grad.dtype == buf.group.dtype else shard_grad.to(buf.group.dtype)
        for i, view in zip(buf.group.trainable, buf.grad_views()):
            self._grads[i] = self.factory.wrap(view, self.layout.params[i])

    def track(self, pending: Pending) -> None:
        """A reduction of this unit's gradients is in flight."""
        self._pending_reduces.append(pending)

    def wait_reduces(self) -> None:
        """Make every reduction of this unit usable where its gradients are read."""
        for pending in self._pending_reduces:
            pending.wait()
        self._pending_reduces = []

    def reduces_waited(self) -> bool:
        """Whether every reduction issued for this unit was waited on (on CPU: its gradients are in place)."""
        return all(pending.waited for pending in self._pending_reduces)

    def reduced_grads(self) -> list[torch.Tensor | None]:
        """Per parameter, the sharded gradient `publish_grads` points `.grad` at when the parameter is used."""
        return list(self._grads)

    def owns_grads(self) -> bool:
        """Whether every published `.grad` is still the view of a flat sharded gradient."""
        return all(self.params[i].grad is self._grads[i] for i, s in enumerate(self.layout.params) if s.requires_grad)

    def publish_grads(self, used: list[bool]) -> None:
        """Point `.grad` of every parameter that got a gradient on any rank at its sharded gradient."""
        for p, grad, u in zip(self.params, self._grads, used):
            if u and grad is not None and p.requires_grad and p.grad is not grad:
                p.grad = grad
        self.used = [False] * len(self.used)

    def release_cleared_grads(self) -> None:
        """Free a group's sharded gradient once the user cleared every `.grad` it holds (set_to_none).

        Note: this keeps gradient memory out of the forward's activation peak, as torch FSDP does. An
        offloaded group keeps its pinned host buffer: pinning is slow and host memory is not the limit.
        """
        for buf in self.buffers:
            if buf.grad is None or buf.offload:
                continue
            if all(self.params[i].grad is None for i in buf.group.trainable):
                buf.grad = None
                for i in buf.group.trainable:
                    self._grads[i] = None

    def accumulate_or_reduce(self, flats: list[tuple[int, torch.Tensor]]) -> None:
        """Keep the rank-major gradients under no_sync; otherwise add what was kept and hand them to the
        runtime, which issues the reduction once this backward node has returned."""
        out = []
        for g, flat in flats:
            kept = self._accumulated.pop(g, None)
            if kept is not None:
                kept += flat
                flat = kept
            if self.runtime.sync_gradients:
                out.append((g, flat))
            else:
                self._accumulated[g] = flat
        if out:
            self.runtime.defer_reduce(self, out)

    def narrow_reduce(self, buf: FlatBuffers, g: int) -> bool:
        """Whether group `g`'s gradient crosses the wire in its compute dtype (comm.narrow_wire)."""
        return (
            buf.group.sharded
            and self.runtime.sync_gradients
            and g not in self._accumulated
            and self.comm.narrow_wire(buf.group.compute_dtype, self.reduce_dtype(buf))
        )
