"""The `st.shard` options an adapter takes from its user, checked when the adapter is built.

The host framework owns the device, the process group and the precision (Fabric's `precision=`,
the Trainer's `precision=`, `TrainingArguments.bf16`): an adapter given those as shard options
refuses them, naming the host's own setting, instead of letting two settings disagree.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..compat import translate_torch_options
from ..policy import is_auto, resolve_module_policy
from ..sharding import shard
from ..strategy import parse_strategy

# st.shard options that the host framework decides, and where the user sets them instead.
_OWNED_BY_HOST = {
    "mixed_precision": "the framework's precision setting (e.g. precision='bf16-mixed')",
    "mp_policy": "the framework's precision setting (e.g. precision='bf16-mixed')",
    "device": "the framework's devices / accelerator settings",
    "device_id": "the framework's devices / accelerator settings",
    "process_group": "the framework's devices / num_nodes settings",
}

_SHARD_ARGS = set(inspect.signature(shard).parameters) - {"model", "torch_options"}

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
    # An unknown name, or an option given in both spellings, fails here rather than at setup.
    translate_torch_options(
        {k: v for k, v in options.items() if k not in _SHARD_ARGS}, given=set(options) & _SHARD_ARGS
    )
    return dict(options)


def shard_precision(owner: str, name: str) -> str | None:
    """The `st.shard(mixed_precision=...)` value of a host precision name; a clear error for the others."""
    if name not in SHARD_PRECISION:
        raise ValueError(f"{owner} does not support precision={name!r}; use one of {sorted(SHARD_PRECISION)}")
    return SHARD_PRECISION[name]


# ShardtrainStrategy's own settings, and those it passes to the Lightning DDP strategy it builds on.
STATE_DICT_TYPES = ("sharded", "full")
# The Lightning DDP strategies' own arguments (Fabric's takes `precision`, the Trainer's `precision_plugin`).
HOST_ARGS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "process_group_backend",
    "timeout",
    "start_method",
)


def strategy_args(
    *, state_dict_type: str, checkpoint_io: Any, kwargs: dict[str, Any], host_args: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a Lightning ShardtrainStrategy's keyword arguments into its DDP base's (`host_args`) and
    `st.shard`'s (checked here)."""
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(f"ShardtrainStrategy(state_dict_type={state_dict_type!r}): use one of {STATE_DICT_TYPES}")
    if checkpoint_io is not None:
        raise ValueError("ShardtrainStrategy(checkpoint_io=...): checkpoints are shardtrain's own; drop it")
    host = {k: v for k, v in kwargs.items() if k in host_args and v is not None}
    options = {k: v for k, v in kwargs.items() if k not in host_args}
    return host, shard_options("ShardtrainStrategy", options)


def convert_precision(plugin: Any, replacements: dict[type, Callable[[Any], Any]], *, host: str) -> Any:
    """The precision plugin `host` chose from its `precision=` name, replaced by the one ShardtrainStrategy
    runs: `replacements` maps each accepted plugin class to a builder of the replacement."""
    shard_precision("ShardtrainStrategy", getattr(plugin, "precision", None))
    build = replacements.get(type(plugin))
    if build is None:
        raise ValueError(
            f"ShardtrainStrategy does not support the precision plugin {type(plugin).__name__}; "
            f"pass {host}(precision=...) by name instead"
        )
    return build(plugin)


def register(cls: type, registry: Any) -> None:
    """Make `strategy="shardtrain"` name `cls` in a Lightning strategy registry."""
    registry.register(
        "shardtrain", cls, description="shardtrain: fully sharded data parallel (st.shard)", override=True
    )
