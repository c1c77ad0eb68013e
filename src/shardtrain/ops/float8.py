"""float8 training (`Engine(float8=True)`, `--train.float8`): torchao's `Float8Linear` in place of the
Linears that gain from it, swapped in before the model is sharded.

`float8_rule.converts` decides which Linears convert (not the output head, features multiples of 16 and large
enough for the casts to pay); compile is required, so float8 without it is refused rather than turned
on. A 4-bit base (QLoRA) is refused too: its frozen layers are `NF4Linear`s, not Linears, and its
adapters are below the size rule, so nothing would convert. A `Float8Linear` keeps the Linear's weight
under the same name, so checkpoints and exports are a bf16 run's. The rule and its thresholds: docs/api.md (`float8=True`); why no float8 all-gather:
docs/design.md, float8.
"""

from __future__ import annotations

import sys

from torch import nn

from ..float8_rule import ALIGN, MIN_FEATURES, float8_linear_names

__all__ = ["check_float8", "convert_to_float8"]

INSTALL = "pip install 'shardtrain[float8]' (torchao)"


def check_float8(float8: bool, *, compile: bool, tp: int) -> None:
    """The engine's float8 setting against its others: TypeError/ValueError naming the fix."""
    if not isinstance(float8, bool):
        raise TypeError(f"Engine(float8={float8!r}): use True or False")
    if float8 and not compile:
        raise ValueError(
            "Engine(float8=True) needs compile=True: eager, torchao's float8 casts run as kernels of their own "
            "and the step is slower than bf16; pass compile=True (or float8=False)"
        )
    if float8 and tp > 1:
        raise ValueError(
            f"Engine(float8=True) with tp={tp}: float8 Linears split over tp ranks need torchao's float8 "
            "parallel styles, which the engine's plans do not use; pass tp=1 or float8=False"
        )


def convert_to_float8(model: nn.Module) -> list[str]:
    """Swap the Linears that qualify for torchao's `Float8Linear` in place (before `st.shard`; on the
    meta device too); return their names. ValueError when none qualifies, naming the rule."""
    if any(_is_nf4(module) for module in model.modules()):
        raise ValueError(
            "Engine(float8=True) with a 4-bit base (st.quantize_base(bits=4), QLoRA): float8 converts 16-bit "
            "nn.Linears, the base's are NF4 and the adapters are below the size rule, so none would; train "
            "QLoRA with float8=False, or keep float8 with a 16-bit base (no quantize_base, or bits=16)"
        )
    names = float8_linear_names(model)
    if not names:
        raise ValueError(
            f"float8: no Linear of {type(model).__name__} qualifies (in and out features multiples of "
            f"{ALIGN}, both at least {MIN_FEATURES}, not the output head): float8 pays on large matmuls "
            "only; train this model without float8"
        )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise ImportError(f"float8 training needs torchao: {INSTALL}") from exc
    chosen = set(names)
    # the weights are gathered in the compute dtype and cast per matmul (module docstring)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=False)
    convert_to_float8_training(model, module_filter_fn=lambda _, fqn: fqn in chosen, config=config)
    return names


def _is_nf4(module: nn.Module) -> bool:
    nf4 = sys.modules.get("shardtrain.pretrained.nf4")  # an NF4Linear implies its module is imported
    return nf4 is not None and isinstance(module, nf4.NF4Linear)
