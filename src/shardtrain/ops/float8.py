"""float8 training (`Engine(float8=True)`, `--train.float8`): torchao's `Float8Linear` in place of the
Linears that gain from it, swapped in before the model is sharded.

`converts` decides which Linears convert (not the output head, features multiples of 16 and large
enough for the casts to pay); compile is required, so float8 without it is refused rather than turned
on. A 4-bit base (QLoRA) is refused too: its frozen layers are `NF4Linear`s, not Linears, and its
adapters are below the size rule, so nothing would convert. A `Float8Linear` keeps the Linear's weight
under the same name, so checkpoints and exports are a bf16 run's. The rule and its thresholds: docs/api.md (`float8=True`); why no float8 all-gather:
docs/design.md, float8.
"""

from __future__ import annotations

import sys

from torch import nn

from ..models.llama import OutputHead

__all__ = ["MIN_FEATURES", "check_float8", "convert_to_float8", "converts", "converts_shape", "float8_linear_names"]

MIN_FEATURES = 1024
_ALIGN = 16
_TENSORWISE_SMALL = (4096, 1024)  # (in_features, out_features) at or below both: left in bf16
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


def converts(module: nn.Module, *, head: nn.Module | None) -> bool:
    """Whether `module` becomes a float8 Linear (the module docstring's rule); `head` is the output head."""
    if not isinstance(module, nn.Linear) or module is head or isinstance(module, OutputHead):
        return False
    return not _is_float8(module) and converts_shape(in_features=module.in_features, out_features=module.out_features)


def converts_shape(*, in_features: int, out_features: int) -> bool:
    """The size half of `converts`: whether a Linear of this shape (not the head) becomes a float8 Linear;
    the memory estimator applies it to a model's shape (planning/cost/float8_cost.py)."""
    if in_features % _ALIGN or out_features % _ALIGN or min(in_features, out_features) < MIN_FEATURES:
        return False
    return not (in_features <= _TENSORWISE_SMALL[0] and out_features <= _TENSORWISE_SMALL[1])


def float8_linear_names(model: nn.Module) -> list[str]:
    """The qualified names of the Linears of `model` that `convert_to_float8` converts."""
    head = _output_head(model)
    return [name for name, module in model.named_modules() if converts(module, head=head)]


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
            f"{_ALIGN}, both at least {MIN_FEATURES}, not the output head): float8 pays on large matmuls "
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


def _output_head(model: nn.Module) -> nn.Module | None:
    """A transformers model's output embeddings (a peft model's inner model's too), else None (the
    built-in Llama's head is recognised by its class)."""
    transformers = sys.modules.get("transformers")  # a model of transformers implies it is imported
    if transformers is None:
        return None
    hf = next((m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)), None)
    head = None if hf is None else hf.get_output_embeddings()
    return head if isinstance(head, nn.Module) else None


def _is_nf4(module: nn.Module) -> bool:
    nf4 = sys.modules.get("shardtrain.pretrained.nf4")  # an NF4Linear implies its module is imported
    return nf4 is not None and isinstance(module, nf4.NF4Linear)


def _is_float8(module: nn.Module) -> bool:
    float8 = sys.modules.get("torchao.float8.float8_linear")
    return float8 is not None and isinstance(module, float8.Float8Linear)
