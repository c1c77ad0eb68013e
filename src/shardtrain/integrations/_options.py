"""The `st.shard` options an adapter takes from its user, checked when the adapter is built.

The host framework owns the device, the process group and the precision (Fabric's `precision=`,
the Trainer's `precision=`, `TrainingArguments.bf16`): an adapter given those as shard options
refuses them, naming the host's own setting, instead of letting two settings disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..options import ShardOptions, resolve_options
from ..sharding import shard_with
from ._lightning_policies import TreePolicy, split_lightning_policies
from ._qlora import chosen_bits, quantize_peft

# st.shard options that the host framework decides, and where the user sets them instead.
_OWNED_BY_HOST = {
    "mixed_precision": "the framework's precision setting (e.g. precision='bf16-mixed')",
    "mp_policy": "the framework's precision setting (e.g. precision='bf16-mixed')",
    "device": "the framework's devices / accelerator settings",
    "device_id": "the framework's devices / accelerator settings",
    "process_group": "the framework's devices / num_nodes settings",
}

# The host precision names the adapters run. st.shard(mixed_precision=...) takes Lightning's names as they are;
# "bf16-true" builds the model in bf16 (the host's own plugin casts it) and is sharded as it is (None);
# "16-mixed" also steps through st.GradScaler.
HOST_PRECISIONS = ("32-true", "bf16-true", "bf16-mixed", "16-mixed")


def shard_options(owner: str, options: dict[str, Any]) -> ShardOptions:
    """`options` (keyword arguments of `st.shard`) for `owner` (the adapter's name), read once: an unknown
    name, a bad value or an option given in both spellings fails here rather than at setup."""
    for name, where in _OWNED_BY_HOST.items():
        if name in options:
            raise ValueError(f"{owner}({name}=...): the framework sets this; use {where}")
    return resolve_options(**options)


@dataclass(frozen=True, kw_only=True)
class StrategyOptions:
    """A Lightning ShardtrainStrategy's `st.shard` options: `options` read when the strategy is built,
    Lightning's tree policies (`_lightning_policies.py`), which set their option once the model is known,
    and the frozen base's bits (4: its peft model's base quantised to NF4 first, `_qlora.py`)."""

    options: ShardOptions
    tree_policies: dict[str, TreePolicy] = field(default_factory=dict)
    base_bits: int = 16

    def for_model(self, module: nn.Module) -> ShardOptions:
        """The options for `module`; with `base_bits=4` its base is quantised now, in place."""
        chosen = {option: policy.on(module) for option, policy in self.tree_policies.items()}
        init = quantize_peft(
            module, bits=self.base_bits, param_init_fn=self.options.param_init_fn, owner="ShardtrainStrategy"
        )
        return dataclasses.replace(self.options, **chosen, param_init_fn=init)


def shard_hosted(module: nn.Module, strategy: StrategyOptions, *, device: torch.device, precision: str) -> nn.Module:
    """Shard `module` with a strategy's options on the host's `device` under the host's `precision` name."""
    host = resolve_options(device=device, mixed_precision=shard_precision("ShardtrainStrategy", precision))
    options = strategy.for_model(module)
    return shard_with(module, dataclasses.replace(options, device=host.device, precision=host.precision))


def shard_precision(owner: str, name: str) -> str | None:
    """The `st.shard(mixed_precision=...)` value of a host precision name; a clear error for the others."""
    if name not in HOST_PRECISIONS:
        raise ValueError(f"{owner} does not support precision={name!r}; use one of {sorted(HOST_PRECISIONS)}")
    return None if name == "bf16-true" else name


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
) -> tuple[dict[str, Any], StrategyOptions]:
    """Split a Lightning ShardtrainStrategy's keyword arguments into its DDP base's (`host_args`) and
    `st.shard`'s (checked here), Lightning FSDPStrategy's policy arguments among the latter."""
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(f"ShardtrainStrategy(state_dict_type={state_dict_type!r}): use one of {STATE_DICT_TYPES}")
    if checkpoint_io is not None:
        raise ValueError("ShardtrainStrategy(checkpoint_io=...): checkpoints are shardtrain's own; drop it")
    bits = chosen_bits(
        "ShardtrainStrategy", bits=kwargs.pop("base_bits", 16), load_in_4bit=kwargs.pop("load_in_4bit", False)
    )
    host = {k: v for k, v in kwargs.items() if k in host_args and v is not None}
    options, tree_policies = split_lightning_policies({k: v for k, v in kwargs.items() if k not in host_args})
    return host, StrategyOptions(
        options=shard_options("ShardtrainStrategy", options), tree_policies=tree_policies, base_bits=bits
    )


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
