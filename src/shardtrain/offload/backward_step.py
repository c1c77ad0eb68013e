"""When host-stepped units may step during backward, and the proof at `step()` that doing so was exact.

`st.CPUOffload(step_in_backward=True)` is the loop's promise that `optimizer.step()` follows each
synchronising backward with nothing global in between, so a unit's gradients are final once its
reduction landed and `HostSteps` steps it beside the rest of backward. `BackwardSteps` keeps the
promise honest: it stops stepping early for good (one warning) once the loop shows anything global,
and raises one clear error naming what changed where it could not see it coming. What it watches
and what it refuses: docs/design.md, Note [Overlapped host step].
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..core.sharded_param import local_of

if TYPE_CHECKING:
    from ..core.unit import ShardUnit

OPT_OUT = "st.CPUOffload(step_in_backward=False)"


@dataclass(frozen=True, kw_only=True)
class SteppedEarly:
    """What one unit stepped with during backward, checked against what `step()` is given."""

    unit: ShardUnit
    params: frozenset[int]  # ids of the parameters stepped
    grads: tuple[tuple[torch.Tensor, tuple[int, int]], ...]  # each `.grad` it read; its and its rows' versions


class BackwardSteps:
    """The loop's observed shape and the units stepped during the current backward (module docstring)."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.reason: str | None = None  # what global the loop does (None: nothing seen)
        self.optimizer: weakref.ref[torch.optim.Optimizer] | None = None  # the one that steps the units
        self.stepped: dict[int, SteppedEarly] = {}  # unit index -> its early step, until step() confirms it
        self.groups: list[dict[str, Any]] | None = None  # the hyperparameters the units stepped with
        self._synced = 0  # synchronising backwards since the last step()
        # each flat gradient when backward ended: (it, its version, a sample of its bits)
        self._then: list[tuple[torch.Tensor, int, torch.Tensor]] = []

    def optimizer_now(self) -> torch.optim.Optimizer | None:
        """The optimizer to step units with during this backward, or None when the loop does not allow it."""
        if not self.enabled or self.reason is not None or self.optimizer is None:
            return None
        return self.optimizer()

    # ------------------------------------------------------------------ the loop's shape
    def note(self, reason: str) -> None:
        """The loop does something global: units step after backward from now on (exact); say so once."""
        if self.reason is None and self.enabled:
            warnings.warn(
                f"shardtrain: step_in_backward=True, but {reason}: the host-stepped units step after "
                f"backward instead (exact; set {OPT_OUT} to silence this)",
                RuntimeWarning,
                stacklevel=4,
            )
        self.reason = self.reason or reason

    def backward_ended(self, units: list[ShardUnit]) -> None:
        """A synchronising backward ended and its gradients are on the host: count it, and remember each
        flat gradient's version and a sample of its bits."""
        self._synced += 1
        self._then = [
            (buf.grad, buf.grad._version, _sample(buf.grad))
            for unit in units
            for buf in unit.buffers
            if buf.grad is not None
        ]

    def _changed_since_backward(self) -> bool:
        """Whether a flat gradient changed since backward ended.

        Note: versions catch in-place ops on the flat gradients and per-tensor ops on the DTensor
        `.grad`s, but torch's foreach ops on DTensors (`clip_grad_norm_`, `GradScaler.unscale_`) bump
        no version (torch 2.13); a global scaling changes every nonzero element, so a sample of each
        flat gradient is compared bit for bit too.
        """
        return any(
            grad._version != version or not torch.equal(_sample(grad), bits) for grad, version, bits in self._then
        )

    # ------------------------------------------------------------------ the proof
    def record(self, unit: ShardUnit, pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        self.stepped[unit.index] = SteppedEarly(
            unit=unit,
            params=frozenset(id(p) for p, _ in pairs),
            grads=tuple((grad, (grad._version, local_of(grad)._version)) for _, grad in pairs),
        )

    def at_step(
        self,
        *,
        early: bool,
        mine: list[torch.nn.Parameter],
        unit_of: dict[int, ShardUnit],
        groups: list[dict[str, Any]],
        amp: dict[str, torch.Tensor],
        unsplittable: str | None,
    ) -> set[int]:
        """`step()` came. Without units stepped early (`early`), note what the loop shows; with them,
        raise unless the step would have stepped them exactly as they were stepped. Returns the units
        already stepped (the step must not step them again)."""
        changed = self._changed_since_backward()
        synced, self._synced, self._then = self._synced, 0, []
        if not early:
            if amp:
                self.note("a GradScaler hands step() its loss scale")
            elif synced > 1:
                self.note(f"{synced} synchronising backwards came before step() (accumulate under st.no_sync)")
            elif changed:
                self.note("the gradients were changed in place between backward and step() (clipping, unscaling)")
            return set()
        what = f"step() cannot step per unit ({unsplittable})" if unsplittable else None
        what = what or ("a GradScaler handed step() its loss scale" if amp else None)
        what = what or _changed_hyperparameter(self.groups or [], groups)
        what = what or (
            "the gradients were changed in place after they stepped (clipping, unscaling)" if changed else None
        )
        given: dict[int, set[int]] = {}
        for p in mine:
            given.setdefault(unit_of[id(p)].index, set()).add(id(p))
        for index, stepped in self.stepped.items():
            if what:
                break
            if given.get(index, set()) != stepped.params:
                what = f"step() was given other gradients of unit {stepped.unit.label!r} than it stepped with"
            elif any((grad._version, local_of(grad)._version) != versions for grad, versions in stepped.grads):
                what = f"the gradients of unit {stepped.unit.label!r} were changed in place after it stepped"
            elif any(p.grad is not grad for p, (grad, _) in zip(_params(stepped, mine), stepped.grads)):
                what = f"the .grad of unit {stepped.unit.label!r} was replaced after it stepped"
        if what:
            self._fail(what)
        confirmed = set(self.stepped)
        self.stepped, self.groups = {}, None
        return confirmed

    def check_stepped(self, what: str) -> None:
        """Raise if units stepped during backward and `what` comes before the `step()` that confirms them."""
        if self.stepped:
            self._fail(
                f"{what} came before the optimizer.step() that they belong to (a skipped step, or "
                "accumulation without st.no_sync)"
            )

    def allow_clipping(self, coef: torch.Tensor, total: torch.Tensor, max_norm: float) -> bool:
        """`st.clip_grad_norm_` is about to scale the gradients by `coef`: note that the loop clips; raise if
        units already stepped and the clipping changes anything; return whether to scale at all."""
        self.note("the loop clips gradients (st.clip_grad_norm_)")
        if not self.stepped:
            return True
        if not bool(torch.isfinite(total)) or float(coef) != 1.0:
            self._fail(f"st.clip_grad_norm_ found the norm {float(total)} (max_norm {max_norm}) after they stepped")
        return False  # scaling by 1 changes no value the early steps read

    def _fail(self, what: str) -> None:
        labels = sorted(early.unit.label for early in self.stepped.values())
        self.stepped = {}
        raise RuntimeError(
            f"shardtrain: units {labels} already stepped during backward (st.CPUOffload(step_in_backward=True)), "
            f"but {what}; the step is no longer exact: set {OPT_OUT} for this loop"
        )


SAMPLES = 16  # elements sampled from each flat gradient


def _sample(grad: torch.Tensor) -> torch.Tensor:
    """SAMPLES elements of `grad` at evenly spaced places, as raw bits."""
    flat = grad.detach().reshape(-1)
    step = max(1, flat.numel() // SAMPLES)
    return flat[::step][:SAMPLES].clone().view(torch.uint8)


def _params(early: SteppedEarly, mine: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters of `early`, in the order its gradients were recorded."""
    by_id = {id(p): p for p in mine if id(p) in early.params}
    return [p for p in early.unit.params if id(p) in by_id]


def _changed_hyperparameter(before: list[dict[str, Any]], now: list[dict[str, Any]]) -> str | None:
    """Which hyperparameter of which param group differs between the early steps and `step()`."""
    if len(before) != len(now):
        return f"the optimizer has {len(now)} param groups, not the {len(before)} the units stepped with"
    for j, (old, new) in enumerate(zip(before, now)):
        for key in sorted(old.keys() | new.keys()):
            a, b = old.get(key), new.get(key)
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b
            if not same:
                return (
                    f"param group {j}'s {key!r} is {b!r} at step(), not the {a!r} the units stepped with "
                    "(set hyperparameters before backward, e.g. scheduler.step() right after optimizer.step())"
                )
    return None
