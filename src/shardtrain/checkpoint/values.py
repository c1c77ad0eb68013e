"""Plain values in metadata.json, and the check that object state dicts load with weights_only.

JSON keeps ints, floats, strings, bools, None, lists and string-keyed dicts; `encode` tags the rest
that checkpoints meet (tuples, dicts with other keys, 0-dim tensors such as Adam's `step`) so that
`decode(encode(v))` gives back an equal value of the same type.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from .format import dtype_code, dtype_of

_PRIMITIVES = (type(None), bool, int, float, str)


def encode(value: Any, where: str) -> Any:
    """`value` as JSON; `where` names it in the error for a value JSON cannot hold."""
    if isinstance(value, _PRIMITIVES):
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(
                f"{where} is a tensor of shape {tuple(value.shape)}; checkpoints store plain values as "
                "JSON metadata: pass a number (.item()), a list (.tolist()), or put the tensor in an "
                "object with state_dict()/load_state_dict()"
            )
        return {"$tensor": value.item(), "dtype": dtype_code(value.dtype)}
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {"$items": [[encode(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise ValueError(
        f"{where} is a {type(value).__name__}, which a checkpoint cannot store as a plain value; use "
        "numbers, strings, lists, tuples and dicts of them, or give the object state_dict() and "
        "load_state_dict()"
    )


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "$tensor" in value:
        return torch.tensor(value["$tensor"], dtype=dtype_of(value["dtype"]))
    if "$tuple" in value:
        return tuple(decode(v) for v in value["$tuple"])
    if "$items" in value:
        return {decode(k): decode(v) for k, v in value["$items"]}
    return {k: decode(v) for k, v in value.items()}


_WEIGHTS_ONLY_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.Size, torch.device)
_WEIGHTS_ONLY_CONTAINERS = (dict, OrderedDict, list, tuple)


def check_weights_only(value: Any, where: str) -> None:
    """Raise unless `torch.load(..., weights_only=True)` can read `value` back (tensors and primitives)."""
    if type(value) in (torch.Tensor, torch.nn.Parameter) or isinstance(value, _WEIGHTS_ONLY_LEAVES):
        return
    if type(value) in _WEIGHTS_ONLY_CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(value, dict):
                check_weights_only(k, f"{where} key {k!r}")
            check_weights_only(v, f"{where}[{k!r}]")
        return
    raise ValueError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; checkpoints read object "
        "state with torch.load(weights_only=True), which accepts only tensors, primitives and "
        "dicts/lists/tuples of them: make state_dict() return plain values"
    )
