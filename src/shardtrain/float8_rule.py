"""Which Linears float8 training converts (`Engine(float8=True)`, `--train.float8`): not the output head,
in and out features multiples of 16 and both large enough for the casts to pay, not torchao's small
tensorwise shapes. One rule for the conversion (ops/float8.py) and the memory and speed estimate
(planning/cost/float8_cost.py), kept at the bottom layer so both can read it.
"""

from __future__ import annotations

import sys

from torch import nn

from .models.llama import OutputHead

__all__ = ["ALIGN", "MIN_FEATURES", "converts", "converts_shape", "float8_linear_names"]

MIN_FEATURES = 1024
ALIGN = 16
_TENSORWISE_SMALL = (4096, 1024)  # (in_features, out_features) at or below both: left in bf16


def converts(module: nn.Module, *, head: nn.Module | None) -> bool:
    """Whether `module` becomes a float8 Linear (the module docstring's rule); `head` is the output head."""
    if not isinstance(module, nn.Linear) or module is head or isinstance(module, OutputHead):
        return False
    return not _is_float8(module) and converts_shape(in_features=module.in_features, out_features=module.out_features)


def converts_shape(*, in_features: int, out_features: int) -> bool:
    """The size half of `converts`: whether a Linear of this shape (not the head) becomes a float8 Linear;
    the memory estimator applies it to a model's shape (planning/cost/float8_cost.py)."""
    if in_features % ALIGN or out_features % ALIGN or min(in_features, out_features) < MIN_FEATURES:
        return False
    return not (in_features <= _TENSORWISE_SMALL[0] and out_features <= _TENSORWISE_SMALL[1])


def float8_linear_names(model: nn.Module) -> list[str]:
    """The qualified names of the Linears of `model` that `convert_to_float8` converts."""
    head = _output_head(model)
    return [name for name, module in model.named_modules() if converts(module, head=head)]


def _output_head(model: nn.Module) -> nn.Module | None:
    """A transformers model's output embeddings (a peft model's inner model's too), else None (the
    built-in Llama's head is recognised by its class)."""
    transformers = sys.modules.get("transformers")  # a model of transformers implies it is imported
    if transformers is None:
        return None
    hf = next((m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)), None)
    head = None if hf is None else hf.get_output_embeddings()
    return head if isinstance(head, nn.Module) else None


def _is_float8(module: nn.Module) -> bool:
    float8 = sys.modules.get("torchao.float8.float8_linear")
    return float8 is not None and isinstance(module, float8.Float8Linear)
