"""torch FSDP's spellings of `st.shard`'s options, mapped onto shardtrain's own in one place.

A script written for `FullyShardedDataParallel(...)` or `fully_shard(...)` passes its keyword
arguments to `st.shard` unchanged: each is translated here into the one shardtrain option that means
the same, or refused with the reason when shardtrain cannot honour it. Giving both spellings of one
option is an error (they might disagree). torch's policy objects (`MixedPrecision`,
`MixedPrecisionPolicy`, `CPUOffload`, `CPUOffloadPolicy`) are accepted under either name.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .policy import CPUOffload, MixedPrecision, SizePolicy

_SUPPORTED = (
    "sharding_strategy",
    "auto_wrap_policy",
    "device_id",
    "forward_prefetch",
    "backward_prefetch",
    "limit_all_gathers",
    "reshard_after_forward",
    "use_orig_params",
    "mp_policy",
    "offload_policy",
)


def translate_torch_options(options: dict[str, Any], *, given: set[str]) -> dict[str, Any]:
    """shardtrain options for torch FSDP keyword `options`; `given` names the shardtrain options the
    caller set explicitly (a torch spelling may not set them again)."""
    unknown = sorted(set(options) - set(_SUPPORTED))
    if unknown:
        raise TypeError(
            f"st.shard() got unexpected keyword arguments {unknown}; its options are strategy, wrap, "
            "mixed_precision, activation_checkpointing, cpu_offload, mesh, device, process_group, prefetch, "
            f"param_init_fn, sync_module_states, and torch FSDP's spellings {list(_SUPPORTED)}"
        )
    out: dict[str, Any] = {}

    def put(key: str, value: Any, source: str) -> None:
        if key in given or key in out:
            raise ValueError(f"st.shard got both {key}= and torch's {source}=; pass one of them")
        out[key] = value

    for name, value in options.items():
        if name == "sharding_strategy":
            put("strategy", value, name)
        elif name == "reshard_after_forward":
            if not isinstance(value, bool):
                raise ValueError(
                    f"reshard_after_forward={value!r}: shardtrain takes True (full_shard) or False (shard_grad_op)"
                )
            put("strategy", "full_shard" if value else "shard_grad_op", name)
        elif name == "auto_wrap_policy":
            put("wrap", _wrap_policy(value), name)
        elif name == "device_id":
            put("device", torch.device("cuda", value) if isinstance(value, int) else value, name)
        elif name == "mp_policy":
            put("mixed_precision", _mixed_precision(value), name)
        elif name == "offload_policy":
            put("cpu_offload", _cpu_offload(value), name)
        elif name == "use_orig_params":
            if value is not True:
                raise ValueError(
                    "use_orig_params=False asks for flat parameters; shardtrain always gives the "
                    "optimizer the original parameters (as use_orig_params=True does): drop it"
                )
    prefetch = _prefetch(options)
    if prefetch is not None:
        put("prefetch", prefetch, "forward_prefetch/backward_prefetch/limit_all_gathers")
    return out


def translate_policy_objects(*, mixed_precision: Any, cpu_offload: Any) -> tuple[Any, Any]:
    """torch's `MixedPrecision` / `MixedPrecisionPolicy` and `CPUOffload` / `CPUOffloadPolicy` objects
    given under shardtrain's own option names, as shardtrain's policies (others pass through)."""
    if _is_torch_object(mixed_precision):
        mixed_precision = _mixed_precision(mixed_precision)
    if _is_torch_object(cpu_offload):
        cpu_offload = _cpu_offload(cpu_offload)
    return mixed_precision, cpu_offload


def _is_torch_object(value: Any) -> bool:
    return type(value).__module__.startswith("torch.distributed")


def _wrap_policy(policy: Any) -> Any:
    """torch's ModuleWrapPolicy, transformer_auto_wrap_policy and size_based_auto_wrap_policy partials."""
    classes = getattr(policy, "_module_classes", None)
    if classes is not None:
        return set(classes)
    if isinstance(policy, functools.partial):
        name = getattr(policy.func, "__name__", "")
        if name == "transformer_auto_wrap_policy" and "transformer_layer_cls" in policy.keywords:
            return set(policy.keywords["transformer_layer_cls"])
        if name == "size_based_auto_wrap_policy":
            return SizePolicy(min_params=int(policy.keywords.get("min_num_params", 100_000_000)))
    raise ValueError(
        f"auto_wrap_policy={policy!r} is not one shardtrain can read; pass wrap= a set of module "
        "classes, st.SizePolicy(min_params=...) or a callable(module) -> bool"
    )


def _mixed_precision(policy: Any) -> Any:
    if not _is_torch_object(policy):
        return policy
    return MixedPrecision(
        param_dtype=getattr(policy, "param_dtype", None),
        reduce_dtype=getattr(policy, "reduce_dtype", None),
        buffer_dtype=getattr(policy, "buffer_dtype", None),
        cast_forward_inputs=bool(getattr(policy, "cast_forward_inputs", True)),
    )


def _cpu_offload(policy: Any) -> Any:
    if not _is_torch_object(policy):
        return policy
    if type(policy).__name__ == "OffloadPolicy":  # FSDP2's "no offload" base class
        return False
    return CPUOffload() if getattr(policy, "offload_params", True) else False


def _prefetch(options: dict[str, Any]) -> int | None:
    """Units gathered ahead, from FSDP1's three switches (None when none of them is given).

    shardtrain always prefetches in the recorded order of both passes; `limit_all_gathers=False`
    allows two units in flight, and turning both prefetches off allows none."""
    names = ("forward_prefetch", "backward_prefetch", "limit_all_gathers")
    if not any(n in options for n in names):
        return None
    for name in ("forward_prefetch", "limit_all_gathers"):
        if not isinstance(options.get(name, True), bool):
            raise TypeError(f"{name}={options[name]!r}: use True or False")
    backward = options.get("backward_prefetch")
    if not (backward is None or isinstance(backward, bool) or type(backward).__name__ == "BackwardPrefetch"):
        raise TypeError(
            f"backward_prefetch={backward!r}: use torch's BackwardPrefetch.BACKWARD_PRE or BACKWARD_POST, "
            "True, False or None"
        )
    forward = bool(options.get("forward_prefetch", True))
    backward = options.get("backward_prefetch", True)
    backward = backward is not None and backward is not False
    if not forward and not backward:
        return 0
    return 1 if options.get("limit_all_gathers", True) else 2
