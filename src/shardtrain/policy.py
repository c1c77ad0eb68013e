"""User-facing policies: what becomes a unit, mixed precision, CPU offload.

Each is a small frozen dataclass; `resolve_module_policy` turns every accepted form of a module
policy (set of classes, `SizePolicy`, callable, None) into one predicate.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ModulePredicate = Callable[[nn.Module], bool]


@dataclass(frozen=True, kw_only=True)
class SizePolicy:
    """Make a unit of every module whose parameters not yet claimed by a child unit reach `min_params`."""

    min_params: int = 100_000_000

    def __post_init__(self) -> None:
        if isinstance(self.min_params, bool) or not isinstance(self.min_params, int) or self.min_params < 1:
            raise ValueError(f"SizePolicy(min_params={self.min_params!r}): min_params must be a positive int")


# What `wrap=` and `activation_checkpointing=` accept: module classes, a size policy, or a predicate.
WrapPolicy = type[nn.Module] | set | frozenset | list | tuple | SizePolicy | ModulePredicate

_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def _as_dtype(value: Any, what: str) -> torch.dtype | None:
    """A dtype from a torch.dtype, None, or a name such as 'bf16'; ValueError naming `what` otherwise."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.strip().lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.strip().lower()]
    raise ValueError(
        f"MixedPrecision({what}={value!r}): use a torch dtype such as torch.bfloat16, a name among "
        f"{sorted(_DTYPE_NAMES)}, or None"
    )


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Dtypes of the unsharded parameters, of the gradient reduction, and of the buffers.

    None means "keep the dtype of the stored value" (fp32 parameters, fp32 reduction, buffers as built).
    The sharded parameter the optimizer updates always stays in its original (fp32) dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for what in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            object.__setattr__(self, what, _as_dtype(getattr(self, what), what))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecision(cast_forward_inputs={self.cast_forward_inputs!r}): use True or False")


def storage_dtypes(
    dtype: torch.dtype, *, requires_grad: bool, precision: MixedPrecision
) -> tuple[torch.dtype, torch.dtype]:
    """(stored, compute) dtypes of a parameter built in `dtype` under `precision`.

    Under mixed precision a trainable parameter built in a 16-bit dtype keeps an fp32 master (the
    optimizer updates fp32 values); a frozen one stays as built. Floating parameters compute in
    `param_dtype` when it is set, else in the dtype they were built in.
    """
    low = dtype in (torch.bfloat16, torch.float16)
    stored = torch.float32 if requires_grad and low and precision.param_dtype is not None else dtype
    compute = precision.param_dtype if precision.param_dtype is not None and dtype.is_floating_point else dtype
    return stored, compute


@dataclass(frozen=True, kw_only=True)
class CPUOffload:
    """Keep fp32 shards, their gradients and the optimizer state in host memory.

    `fraction` < 1 is partial offload: whole units are offloaded from the end of the plan order (the
    last units of the forward first) until at least that share of the parameters lives on the host;
    the other units stay on the device, so a model that almost fits pays the host optimizer's time
    only for what does not.
    """

    params: bool = True
    optimizer: bool = True
    fraction: float = 1.0
    # Host threads for the optimizer step on the offloaded shards (torch's intra-op threads). None: this
    # process's share of the machine's cores; torchrun otherwise leaves every process one thread.
    threads: int | None = None
    # Step each offloaded unit on the host during backward, as soon as its gradients are final. The
    # loop promises to call optimizer.step() right after each synchronising backward, with nothing
    # global in between (no clipping, loss scaling or skipped steps; accumulation under st.no_sync);
    # step() verifies it (docs/design.md, Note [Overlapped host step]).
    step_in_backward: bool = False
    # The offloaded units' parameters between forward and backward. None: as the strategy says (full_shard
    # copies them to the device again for backward, shard_grad_op keeps them). False keeps the offloaded
    # units' compute-dtype parameters on the device from forward to backward: they cross PCIe once a step
    # instead of twice, which frees host memory bandwidth for the host step, at the cost of their
    # compute-dtype size in device memory (BENCHMARKS.md, "Offloaded optimizer step").
    reshard_after_forward: bool | None = None

    # The disk tier (offload/disk_state.py): a directory for per-rank files holding the offloaded units'
    # optimizer state, streamed through `disk_buffer_bytes` of host buffers (None: 4 units' worth).
    disk_dir: str | None = None
    disk_buffer_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_disk_tier(self)
        if not isinstance(self.step_in_backward, bool):
            raise TypeError(f"CPUOffload(step_in_backward={self.step_in_backward!r}): give True or False")
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, bool):
            raise TypeError(
                f"CPUOffload(reshard_after_forward={self.reshard_after_forward!r}): give True, False, or None for "
                "the strategy's"
            )
        if (
            isinstance(self.fraction, bool)
            or not isinstance(self.fraction, (int, float))
            or not 0.0 < self.fraction <= 1.0
        ):
            raise ValueError(
                f"CPUOffload(fraction={self.fraction!r}): the share of parameters to offload must be in "
                "(0, 1]; use cpu_offload=False to offload nothing"
            )
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(
                f"CPUOffload(threads={self.threads!r}): give a positive number of host threads, or None "
                "for this process's share of the cores"
            )

    def host_threads(self) -> int:
        """`threads`, or the cores this process may use divided by the processes on this machine."""
        if self.threads is not None:
            return self.threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def reshards_after_forward(self, *, strategy_reshards: bool) -> bool:
        """Whether the offloaded units free their parameters after forward, under a strategy that does
        (`strategy_reshards`) or does not."""
        return strategy_reshards if self.reshard_after_forward is None else self.reshard_after_forward

    def select(self, unit_sizes: Iterable[int]) -> list[bool]:
        """Which units (given in plan order, by parameter count) this policy offloads: the last ones
        first. Those are the units whose gradients are final first in backward and that the next
        forward needs last, so their host steps have the rest of backward and the resident units'
        forward to run beside the GPU (docs/design.md, Note [Overlapped host step])."""
        sizes = list(unit_sizes)
        target, offloaded, chosen = self.fraction * sum(sizes), 0, []
        for size in reversed(sizes):
            chosen.append(offloaded < target)
            offloaded += size if chosen[-1] else 0
        return chosen[::-1]


def _check_disk_tier(policy: CPUOffload) -> None:
    if policy.disk_dir is not None and (
        not isinstance(policy.disk_dir, (str, os.PathLike)) or not os.path.isdir(policy.disk_dir)
    ):
        raise ValueError(f"CPUOffload(disk_dir={policy.disk_dir!r}): give an existing directory on a local disk")
    size = policy.disk_buffer_bytes
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"CPUOffload(disk_buffer_bytes={size!r}): give a positive number of bytes, or None")
    if size is not None and policy.disk_dir is None:
        raise ValueError(f"CPUOffload(disk_buffer_bytes={size!r}) without disk_dir: name the directory for the state")
    if policy.disk_dir is not None and not policy.optimizer:
        raise ValueError("CPUOffload(disk_dir=..., optimizer=False): the disk tier holds offloaded optimizer state")
    if policy.disk_dir is not None and policy.step_in_backward:
        raise ValueError(
            "CPUOffload(disk_dir=..., step_in_backward=True): the disk tier streams each unit's state around the "
            "steps that follow optimizer.step(), not during backward; drop step_in_backward or disk_dir"
        )


@dataclass(frozen=True, kw_only=True)
class AutoPolicy:
    """`st.shard_auto(model, policy=st.AutoPolicy(...))` (or `st.Engine(strategy=st.AutoPolicy(...))`): the
    batch the planner picks strategy, checkpointing and offload for.

    `micro_batch` sequences of `seq_len` tokens per device and step, as the training loop feeds them;
    `device_memory` (bytes or "80GiB") defaults to the local GPU's. `disk_dir` (an existing directory on
    a local disk) lets the plan keep a fully offloaded model's optimizer state there, only when nothing
    fits with device and host memory; `host_memory` (per process) defaults to this host's share then.
    """

    micro_batch: int
    seq_len: int
    device_memory: int | str | None = None
    grad_accum: int = 1
    disk_dir: str | None = None
    host_memory: int | str | None = None


_PRECISION_NAMES = {
    "bf16": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16-mixed": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "fp16": MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
    "16-mixed": MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
    "fp32": MixedPrecision(),
    "32": MixedPrecision(),
    "32-true": MixedPrecision(),
}


def parse_mixed_precision(value: Any) -> MixedPrecision:
    if value is None:
        return MixedPrecision()
    if isinstance(value, MixedPrecision):
        return value
    if isinstance(value, str) and value.lower() in _PRECISION_NAMES:
        return _PRECISION_NAMES[value.lower()]
    raise ValueError(
        f"mixed_precision={value!r} is not understood; use None, one of {sorted(_PRECISION_NAMES)}, "
        "or st.MixedPrecision(param_dtype=..., reduce_dtype=..., buffer_dtype=...)"
    )


def parse_cpu_offload(value: Any) -> CPUOffload | None:
    if value is None or value is False:
        return None
    if value is True:
        return CPUOffload()
    if isinstance(value, float):  # cpu_offload=0.5: partial offload of that share of the parameters
        if not 0.0 < value <= 1.0:
            raise ValueError(
                f"cpu_offload={value!r}: a share of the parameters must be in (0, 1]; use True for all, False for none"
            )
        return CPUOffload(fraction=value)
    if isinstance(value, CPUOffload):
        if not value.params and not value.optimizer:
            return None
        if not (value.params and value.optimizer):
            raise ValueError(
                f"cpu_offload={value!r}: the optimizer steps the shard where it lives, so parameters and "
                "optimizer state are offloaded together; use st.CPUOffload(params=True, optimizer=True)"
            )
        return value
    raise TypeError(
        f"cpu_offload={value!r}: use True, False, a share of the parameters such as 0.5, or "
        "st.CPUOffload(params=..., optimizer=..., fraction=...)"
    )


def describe_policy(policy: Any) -> str:
    if isinstance(policy, (set, frozenset, list, tuple)):
        return "{" + ", ".join(sorted(c.__name__ for c in policy)) + "}"
    if isinstance(policy, SizePolicy):
        return repr(policy)
    return getattr(policy, "__name__", repr(policy))


def resolve_module_policy(policy: Any, *, what: str) -> ModulePredicate | SizePolicy | None:
    """Normalise a module policy; a `SizePolicy` is returned as is (it needs the tree, not one module)."""
    if policy is None or isinstance(policy, SizePolicy):
        return policy
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"{what}={policy!r}: every entry must be an nn.Module subclass, got {bad!r}")
        return lambda module: isinstance(module, classes)
    if callable(policy):
        return policy
    raise TypeError(
        f"{what}={policy!r} is not a policy; use a set of module classes, st.SizePolicy(min_params=...), "
        "a callable(module) -> bool, or None"
    )


def module_classes(modules: Iterable[nn.Module]) -> list[str]:
    return sorted({type(m).__name__ for m in modules})


def classes_named(model: nn.Module, names: Iterable[str], *, what: str) -> frozenset[type[nn.Module]]:
    """Every module class of `model` whose name is in `names` (layer classes named in a config, or a
    model's `_no_split_modules`); ValueError naming `what` (where the names came from) and the model's
    classes when a name matches none."""
    names = tuple(names)
    found = frozenset(type(m) for m in model.modules() if type(m).__name__ in names)
    missing = sorted(set(names) - {c.__name__ for c in found})
    if missing:
        raise ValueError(
            f"{what} names {missing}, which are not module classes of {type(model).__name__}; its classes are "
            f"{module_classes(model.modules())}"
        )
    return found
