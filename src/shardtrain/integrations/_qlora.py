"""A 4-bit base (QLoRA) for the integrations: the option users know, `base_bits=4` or `load_in_4bit=True`,
turned into `st.quantize_base` on the peft model inside the framework's module before it is sharded."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def chosen_bits(owner: str, *, bits: int, load_in_4bit: bool) -> int:
    """The frozen base's bits that `owner` was given: 4 with `base_bits=4` or `load_in_4bit=True`, else 16."""
    if bits not in (4, 16):
        raise ValueError(f"{owner}(base_bits={bits!r}): use 4 (an NF4 base, QLoRA) or 16 (the base as built)")
    if not isinstance(load_in_4bit, bool):
        raise ValueError(f"{owner}(load_in_4bit={load_in_4bit!r}): pass True or False")
    return 4 if load_in_4bit else bits


def quantize_peft(
    module: nn.Module, *, bits: int, param_init_fn: Callable[[nn.Module], None] | None, owner: str
) -> Callable[[nn.Module], None] | None:
    """With `bits=4`, `st.quantize_base` on the peft model in `module` (itself or inside it), in place; the
    `param_init_fn` to shard `module` with. ValueError naming `owner` for a module that holds no peft model."""
    if bits == 16:
        return param_init_fn
    peft = next((m for m in module.modules() if hasattr(m, "peft_config")), None)
    if peft is None:
        raise ValueError(
            f"{owner}(base_bits=4) quantises the frozen base of a peft model, and {type(module).__name__} holds "
            "none: apply LoRA first (peft's get_peft_model), or drop base_bits / load_in_4bit"
        )
    from ..pretrained.qlora import quantize_base

    return quantize_base(peft, bits=4, param_init_fn=param_init_fn)
