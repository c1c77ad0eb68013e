"""`TrainingArguments` -> `st.shard` options, for `ShardtrainTrainer`.

transformers 5 rewrites the documents' `fsdp="full_shard auto_wrap"` (and `"offload"`,
`"shard_grad_op"`) into `fsdp=True` plus `fsdp_config` fields, so reading `fsdp_config` after
`TrainingArguments.__post_init__` covers both spellings. Any other `fsdp_config` key set to a value
other than transformers' default, and arguments that shardtrain does not run (fp16, torch_compile,
...), raise a ValueError naming them. The keys read and what each becomes: docs/integrations.md,
"The Hugging Face Trainer".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..policy import SizePolicy, classes_named

# fsdp_config keys that transformers fills in with these defaults, which shardtrain has nothing to do for.
_INERT_DEFAULTS = {
    "xla": False,
    "xla_fsdp_v2": False,
    "xla_fsdp_grad_ckpt": False,
    "cpu_ram_efficient_loading": False,
    "version": None,  # any: both versions' options are read below
    "forward_prefetch": False,
    "backward_prefetch": "NO_PREFETCH",
    "use_orig_params": True,
    "limit_all_gathers": None,
}
_READ = {
    "reshard_after_forward",
    "auto_wrap_policy",
    "transformer_layer_cls_to_wrap",
    "min_num_params",
    "activation_checkpointing",
    "cpu_offload",
    "sync_module_states",
    "state_dict_type",
}
# TrainingArguments that shardtrain cannot honour, with the value that is fine.
_UNSUPPORTED_ARGS = {
    "fp16": False,
    "fp16_full_eval": False,
    "bf16_full_eval": False,
    "torch_compile": False,
    "deepspeed": None,
    "parallelism_config": None,
}
_STATE_DICT_TYPES = {"FULL_STATE_DICT": "full", "SHARDED_STATE_DICT": "sharded"}


@dataclass(frozen=True, kw_only=True)
class TrainerSharding:
    """What `ShardtrainTrainer` runs: `st.shard`'s options and the checkpoints' format."""

    shard: dict[str, Any]
    checkpoint_format: str = "sharded"


def _flag(value: Any) -> bool:
    return str(value).lower() in ("true", "1", "yes")


def _check_args(args: Any) -> None:
    for name, fine in _UNSUPPORTED_ARGS.items():
        value = getattr(args, name, fine)
        if value != fine and not (fine is False and not value):
            raise ValueError(
                f"TrainingArguments({name}={value!r}) is not supported by ShardtrainTrainer; leave it at {fine!r}"
                + (" (bf16=True trains in bf16 with fp32 master weights)" if name == "fp16" else "")
            )
    if getattr(args, "load_best_model_at_end", False) and getattr(args, "save_only_model", False):
        raise ValueError(
            "TrainingArguments(load_best_model_at_end=True, save_only_model=True): ShardtrainTrainer loads the best "
            "model from the checkpoint's shardtrain/ folder, which save_only_model=True does not write; drop "
            "save_only_model"
        )


def _wrap(model: nn.Module, config: dict[str, Any]) -> Any:
    policy = str(config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    if policy == "NO_WRAP":
        return None
    if policy == "SIZE_BASED_WRAP":
        return SizePolicy(min_params=int(config.get("min_num_params") or 100_000_000))
    if policy != "TRANSFORMER_BASED_WRAP":
        raise ValueError(
            f"fsdp_config['auto_wrap_policy']={policy!r}: use TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP"
        )
    names = config.get("transformer_layer_cls_to_wrap") or list(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(
            f"{type(model).__name__} names no layer classes (_no_split_modules); set "
            "fsdp_config['transformer_layer_cls_to_wrap'] to the decoder layer's class name"
        )
    return set(classes_named(model, names, what="fsdp_config['transformer_layer_cls_to_wrap']"))


def _strategy(config: dict[str, Any]) -> str:
    reshard = config.get("reshard_after_forward", True)
    if isinstance(reshard, str) and reshard.lower() not in ("true", "false"):
        return reshard.lower()  # FSDP1: a sharding strategy name (st.shard takes torch's names)
    return "full_shard" if _flag(reshard) else "shard_grad_op"


def trainer_sharding(args: Any, model: nn.Module) -> TrainerSharding:
    """Read `args` (TrainingArguments after __post_init__) for `model`; raise on what shardtrain cannot run."""
    _check_args(args)
    config = dict(args.fsdp_config or {}) if args.fsdp else {}
    for key, value in config.items():
        if key in _READ:
            continue
        if key in _INERT_DEFAULTS and (
            _INERT_DEFAULTS[key] is None or str(value).lower() == str(_INERT_DEFAULTS[key]).lower()
        ):
            continue
        raise ValueError(f"fsdp_config[{key!r}]={value!r} is not supported by ShardtrainTrainer; remove it")
    wrap = _wrap(model, config)
    # TrainingArguments.activation_checkpointing is newer than 5.17 (which has only fsdp_config's key).
    checkpointing = _flag(config.get("activation_checkpointing", False)) or bool(
        getattr(args, "activation_checkpointing", False)
    )
    if checkpointing and not isinstance(wrap, set):
        raise ValueError(
            "activation checkpointing needs the layer classes: set fsdp_config['transformer_layer_cls_to_wrap'] "
            "(or leave auto_wrap_policy at TRANSFORMER_BASED_WRAP)"
        )
    state_dict_type = str(config.get("state_dict_type", "SHARDED_STATE_DICT")).upper()
    if state_dict_type not in _STATE_DICT_TYPES:
        raise ValueError(f"fsdp_config['state_dict_type']={state_dict_type!r}: use one of {sorted(_STATE_DICT_TYPES)}")
    shard = {
        "strategy": _strategy(config) if config else "full_shard",
        "wrap": wrap,
        "activation_checkpointing": wrap if checkpointing else None,
        "mixed_precision": "bf16" if args.bf16 else None,
        "cpu_offload": _flag(config.get("cpu_offload", False)),
        "sync_module_states": _flag(config.get("sync_module_states", False)),
    }
    return TrainerSharding(shard=shard, checkpoint_format=_STATE_DICT_TYPES[state_dict_type])
