"""peft's LoRA on a model built on the meta device, with adapters initialised as peft initialises them.

`get_peft_model` on a meta model makes its adapters on the meta device too, where peft's own
initialisation does nothing. `st.shard` materialises modules unit by unit and calls
`param_init_fn(module)` for each; `adapter_init` is that function: for the adapter matrices it runs
the layer's own `reset_lora_parameters` (A as `nn.Linear`'s Kaiming-uniform, B zeros, so the adapted
model starts equal to its base) once both of a layer's matrices exist; every other module gets what
`st.shard` would have given it (its Hugging Face model's `_init_weights`, else `reset_parameters()`).
Only initialisations that need no base weights are supported (`init_lora_weights` True or
"gaussian"): the base weights are loaded after sharding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..core.materialize import DefaultInit
from .nf4 import quiet_torchao

_META_INITS = (True, "gaussian")


def apply_lora(model: nn.Module, *, rank: int, alpha: float, targets: tuple[str, ...], dropout: float) -> nn.Module:
    """`model` (a causal LM, on the meta device) wrapped by peft with LoRA adapters on `targets`; only the
    adapters require gradients."""
    try:
        with quiet_torchao():
            from peft import LoraConfig, get_peft_model
            from peft.utils.constants import INCLUDE_LINEAR_LAYERS_SHORTHAND as ALL_LINEAR
    except ModuleNotFoundError as exc:
        raise ValueError("LoRA needs peft: pip install 'shardtrain[peft]'") from exc
    # peft reads its shorthand ("all-linear": every linear layer but the output head) only as a string
    modules = ALL_LINEAR if tuple(targets) == (ALL_LINEAR,) else list(targets)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=dropout, bias="none", task_type="CAUSAL_LM"
    )
    try:
        with torch.device("meta"):
            return get_peft_model(model, config)
    except ValueError as exc:
        linear = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"lora.targets={','.join(targets)}: {str(exc).splitlines()[0]}; the model's linear layers "
            f"are named {linear}"
        ) from None


def adapter_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """The `param_init_fn` for `st.shard` of peft model `model` built on the meta device (module docstring)."""
    layers: dict[int, tuple[nn.Module, str]] = {}
    for module in model.modules():
        for adapter in getattr(module, "lora_A", {}) if hasattr(module, "reset_lora_parameters") else ():
            init = model.peft_config[adapter].init_lora_weights
            if init not in _META_INITS:
                raise ValueError(
                    f"init_lora_weights={init!r} initialises the adapters from the base weights, which "
                    f"a model built on the meta device does not have yet; use one of {_META_INITS}"
                )
            layers[id(module.lora_A[adapter])] = layers[id(module.lora_B[adapter])] = (module, adapter)
    default = DefaultInit(model)
    done: set[tuple[int, str]] = set()

    def init(module: nn.Module) -> None:
        entry = layers.get(id(module))
        if entry is None:
            default(module)
            return
        layer, adapter = entry
        matrices = (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight)
        if (id(layer), adapter) not in done and not any(m.is_meta for m in matrices):
            layer.reset_lora_parameters(adapter, model.peft_config[adapter].init_lora_weights)
            done.add((id(layer), adapter))

    return init
