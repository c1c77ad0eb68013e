"""`ShardOptions`: every option of `st.shard`, in one form, and the one function that reads them.

A user spells an option many ways: a strategy as "zero3", "FULL_SHARD" or torch's `ShardingStrategy`
member, mixed precision as "bf16", "bf16-mixed" or torch's `MixedPrecisionPolicy`, offload as True,
0.5 or `st.CPUOffload(...)`, and torch FSDP's keyword names (`sharding_strategy=`, `device_id=`, ...)
for all of them (compat.py). `resolve_options` reads every accepted spelling once, at the edge (the
public `st.shard`, the Engine, the trainer adapters, `st.plan`), and returns a `ShardOptions`;
`core.shard_module.shard_module` takes only that object. A new option is a field here, a keyword of
`resolve_options` (and of `st.shard`, which forwards them), and a line of tests/test_options.py.

Three switches for benchmarks and tests are environment variables (docs/api.md, 'Environment';
docs/design.md, Note [Offload settings], says why each exists), read here and nowhere else, into the
last three fields: `SHARDTRAIN_HOST_STEP=overlapped|sequential`, `SHARDTRAIN_GATHER=grouped|flat`
and `SHARDTRAIN_CHECK_ORDER=0`. The host's threads have one setting, `CPUOffload(threads=)`.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .compat import translate_policy_objects, translate_torch_options
from .policy import (
    AutoPolicy,
    CPUOffload,
    MixedPrecision,
    WrapPolicy,
    parse_cpu_offload,
    parse_mixed_precision,
    resolve_module_policy,
)
from .strategy import Strategy, parse_strategy

AUTO = "auto"
HOST_STEP_ENV = "SHARDTRAIN_HOST_STEP"
GATHER_ENV = "SHARDTRAIN_GATHER"
CHECK_ORDER_ENV = "SHARDTRAIN_CHECK_ORDER"


class GatherMode(enum.Enum):
    """How a unit is all-gathered (core/comm.py)."""

    GROUPED = "grouped"  # per-parameter all-gathers straight into the parameter-major buffer
    FLAT = "flat"  # one all-gather of the rank-major chunk, then one copy-out


@dataclass(frozen=True, kw_only=True)
class ShardOptions:
    """Every option of `st.shard`, resolved: the only form `core` reads.

    `device` None is this rank's GPU (LOCAL_RANK), else the CPU, decided when the model is sharded;
    `offload` None is no offload (and offload is dropped on a CPU device, where everything already
    lives in host memory).

    The last three come from the environment only (the module's docstring): `overlap_host_step` False
    steps the offloaded units in the user's `step()`, after backward (offload/host_step.py); `gather` None
    gathers grouped on NCCL and flat on Gloo (core/comm.py); `check_order` False skips the order
    check (core/order_check.py).
    """

    strategy: Strategy = Strategy.FULL_SHARD
    wrap: WrapPolicy | None = None
    precision: MixedPrecision = field(default_factory=MixedPrecision)
    activation_checkpointing: WrapPolicy | None = None
    offload: CPUOffload | None = None
    mesh: DeviceMesh | tuple[int, int] | None = None
    device: torch.device | None = None
    process_group: dist.ProcessGroup | None = None
    prefetch: int = 1
    param_init_fn: Callable[[nn.Module], None] | None = None
    sync_module_states: bool = False
    tp_plan: Mapping[str, Any] | None = None
    overlap_host_step: bool = True
    gather: GatherMode | None = None
    check_order: bool = True

    def __post_init__(self) -> None:
        for name, kind in (("strategy", Strategy), ("precision", MixedPrecision)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"ShardOptions({name}={getattr(self, name)!r}): build it with resolve_options(...)")
        if self.offload is not None and not isinstance(self.offload, CPUOffload):
            raise TypeError(f"ShardOptions(offload={self.offload!r}): build it with resolve_options(...)")
        if self.device is not None and not isinstance(self.device, torch.device):
            raise TypeError(f"ShardOptions(device={self.device!r}): build it with resolve_options(...)")


def resolve_options(
    *,
    strategy: Strategy | str | Any = "full_shard",
    wrap: WrapPolicy | None = None,
    mixed_precision: MixedPrecision | str | Any | None = None,
    activation_checkpointing: WrapPolicy | None = None,
    cpu_offload: CPUOffload | bool | float | Any = False,
    mesh: DeviceMesh | tuple[int, int] | None = None,
    device: torch.device | str | int | None = None,
    process_group: dist.ProcessGroup | None = None,
    prefetch: int = 1,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    sync_module_states: bool = False,
    tp_plan: Mapping[str, Any] | None = None,
    **torch_options: Any,
) -> ShardOptions:
    """Every accepted spelling of `st.shard`'s options (its docstring lists them) as one `ShardOptions`.

    Raises ValueError or TypeError naming the offending value and the fix. strategy="auto" and
    `st.AutoPolicy` are refused here: the automatic plan is `st.shard_auto` (planning/cost/shard_auto.py), a
    tool above this entry point.
    """
    given: dict[str, Any] = dict(
        strategy=strategy,
        wrap=wrap,
        mixed_precision=mixed_precision,
        cpu_offload=cpu_offload,
        device=device,
        prefetch=prefetch,
    )
    given.update(translate_torch_options(torch_options, given=_explicit(given)))
    mixed, offload = translate_policy_objects(
        mixed_precision=given["mixed_precision"], cpu_offload=given["cpu_offload"]
    )
    if not isinstance(sync_module_states, bool):
        raise TypeError(f"sync_module_states={sync_module_states!r}: use True or False")
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"param_init_fn={param_init_fn!r}: pass a callable(module) that fills its parameters, or None")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group={process_group!r}: pass a torch.distributed ProcessGroup (dist.new_group(ranks)), "
            "or None for every rank"
        )
    prefetch = given["prefetch"]
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r}: give the number of units to gather ahead (0, 1, 2, ...)")
    refuse_auto(given["strategy"])
    for what, policy in (("wrap", given["wrap"]), ("activation_checkpointing", activation_checkpointing)):
        resolve_module_policy(policy, what=what)
    offload_policy = parse_cpu_offload(offload)
    overlap = host_step_overlapped()
    if offload_policy is not None and offload_policy.disk_dir is not None and not overlap:
        raise ValueError(
            f"CPUOffload(disk_dir={offload_policy.disk_dir!r}) with {HOST_STEP_ENV}=sequential: the disk tier streams "
            f"the state through the per-unit host step; unset {HOST_STEP_ENV}"
        )
    return ShardOptions(
        strategy=parse_strategy(given["strategy"]),
        wrap=given["wrap"],
        precision=parse_mixed_precision(mixed),
        activation_checkpointing=activation_checkpointing,
        offload=offload_policy,
        mesh=mesh,
        device=_device(given["device"]),
        process_group=process_group,
        prefetch=prefetch,
        param_init_fn=param_init_fn,
        sync_module_states=sync_module_states,
        tp_plan=tp_plan,
        overlap_host_step=overlap,
        gather=_gather_from_env(),
        check_order=os.environ.get(CHECK_ORDER_ENV, "1").strip() not in ("0", "false", "off"),
    )


def host_step_overlapped() -> bool:
    """SHARDTRAIN_HOST_STEP: "overlapped" (the default) or "sequential"; True for overlapped. Read here
    for `resolve_options` and for the planner, which prices the step st.shard will run."""
    value = os.environ.get(HOST_STEP_ENV, "overlapped")
    if value not in ("overlapped", "sequential"):
        raise ValueError(f"{HOST_STEP_ENV}={value!r}: use 'overlapped' or 'sequential'")
    return value == "overlapped"


def _gather_from_env() -> GatherMode | None:
    value = os.environ.get(GATHER_ENV)
    if not value:
        return None
    try:
        return GatherMode(value.strip().lower())
    except ValueError:
        raise ValueError(f"{GATHER_ENV}={value!r}: use 'grouped' or 'flat'") from None


def is_auto(strategy: Any) -> bool:
    """Whether a strategy argument asks the planner to choose ("auto" or an `st.AutoPolicy`)."""
    return isinstance(strategy, AutoPolicy) or (isinstance(strategy, str) and strategy.strip().lower() == AUTO)


def refuse_auto(strategy: Any) -> None:
    """ValueError pointing at `st.shard_auto` for strategy="auto" / `st.AutoPolicy` (a plan, not a strategy)."""
    if is_auto(strategy):
        raise ValueError(
            f"strategy={strategy!r} asks for a plan, not a strategy: call "
            "st.shard_auto(model, policy=st.AutoPolicy(micro_batch=..., seq_len=...), wrap=..., ...), "
            "which picks the strategy, checkpointing and offload and then shards"
        )


def precision_name(precision: str | Any, *, accelerator: str) -> str | Any:
    """precision="auto" as the Engine and `shardtrain train` take it: "bf16-mixed" on CUDA, "32-true"
    on the CPU (where bf16 matmuls are slow); any other value as given."""
    if isinstance(precision, str) and precision == AUTO:
        return "bf16-mixed" if accelerator == "cuda" else "32-true"
    return precision


def offload_setting(fraction: float, *, disk_dir: str | None = None) -> bool | float | CPUOffload:
    """A share of the parameters offloaded (0.0 to 1.0) as `cpu_offload=` and the train config take it:
    False for none, True for all, the share for a part; with `disk_dir` (the disk tier's directory) and
    a share to offload, the `CPUOffload` that keeps the offloaded optimizer state there."""
    if disk_dir is not None and fraction:
        return CPUOffload(fraction=float(fraction), disk_dir=disk_dir)
    return fraction if 0 < fraction < 1 else bool(fraction)


def _device(device: Any) -> torch.device | None:
    if device is None or isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device; use 'cuda', 'cuda:N', 'cpu' or a torch.device") from exc


_DEFAULTS = dict(strategy="full_shard", wrap=None, mixed_precision=None, cpu_offload=False, device=None, prefetch=1)


def _explicit(options: dict[str, Any]) -> set[str]:
    """The options given other than at their defaults (a torch spelling may not contradict them)."""
    return {k for k, v in options.items() if v is not _DEFAULTS[k] and v != _DEFAULTS[k]}
