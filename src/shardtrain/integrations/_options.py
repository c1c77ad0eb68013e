"""The `st.shard` options an adapter takes from its user, checked when the adapter is built.

The host framework owns the device, the process group and the precision (Fabric's `precision=`,
the Trainer's `precision=`, `TrainingArguments.bf16`): an adapter given those as shard options
refuses them, naming the host's own setting, instead of letting two settings disagree.
"""

from __future__ import annotations

from typing import Any

from ..policy import is_auto, resolve_module_policy
from ..strategy import parse_strategy

# st.shard options that the host framework decides, and where the user sets them instead.
_OWNED_BY_HOST = {
    "mixed_precision": "the framework's precision setting (e.g. precision='bf16-mixed')",
    "mp_policy": "the framework's precision setting (e.g. precision='bf16-mixed')",
    "device": "the framework's devices / accelerator settings",
    "device_id": "the framework's devices / accelerator settings",
    "process_group": "the framework's devices / num_nodes settings",
}

# Host precision names -> st.shard(mixed_precision=...). "bf16-true" builds the model in bf16 (the
# host's own plugin casts it) and shards it as it is; "16-mixed" also steps through st.GradScaler.
SHARD_PRECISION = {"32-true": None, "bf16-true": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}


def shard_options(owner: str, options: dict[str, Any]) -> dict[str, Any]:
    """Check `options` (keyword arguments of `st.shard`) for `owner` (the adapter's name); return them."""
    for name, where in _OWNED_BY_HOST.items():
        if name in options:
            raise ValueError(f"{owner}({name}=...): the framework sets this; use {where}")
    if "strategy" in options and not is_auto(options["strategy"]):
        parse_strategy(options["strategy"])
    for what in ("wrap", "activation_checkpointing"):
        resolve_module_policy(options.get(what), what=what)
    return dict(options)


def shard_precision(owner: str, name: str) -> str | None:
    """The `st.shard(mixed_precision=...)` value of a host precision name; a clear error for the others."""
    if name not in SHARD_PRECISION:
        raise ValueError(f"{owner} does not support precision={name!r}; use one of {sorted(SHARD_PRECISION)}")
    return SHARD_PRECISION[name]
