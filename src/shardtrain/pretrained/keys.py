"""How the names of a model's parameters map onto the keys of a pretrained weights file.

Both sides are compared by their base name, which bridges, in both directions, peft's
`base_model.model.` prefix and `base_layer` segments, a task model's `base_model_prefix` and tied
weights stored once; keys the model declares ignorable are neither missing nor unexpected, as in
transformers (docs/pretrained.md, "Key mapping").
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from ..core.param_layout import ParamShard
from ..core.partition import clean_name

PEFT_PREFIX = "base_model.model."
_BASE_LAYER = "base_layer"


def base_name(name: str) -> str:
    """`name` as the un-adapted model calls it: no peft prefix, no `base_layer` segments."""
    return ".".join(part for part in name.removeprefix(PEFT_PREFIX).split(".") if part != _BASE_LAYER)


def hf_model(model: nn.Module) -> nn.Module | None:
    """The outermost transformers `PreTrainedModel` inside `model` (itself, or the model a peft model wraps)."""
    transformers = sys.modules.get("transformers")  # a model of transformers implies it is imported
    if transformers is None:
        return None
    return next((m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)), None)


def adapter_params(model: nn.Module) -> set[str]:
    """Clean names of the parameters peft adds (those of each tuner layer's `adapter_layer_names`)."""
    roots = []
    for path, module in model.named_modules():
        for attr in getattr(module, "adapter_layer_names", ()):
            roots.append(clean_name(f"{path}.{attr}" if path else attr))
    if not roots:
        return set()
    names = {clean_name(n) for n, _ in model.named_parameters(remove_duplicate=False)}
    return {n for n in names if any(n == r or n.startswith(r + ".") for r in roots)}


@dataclass(frozen=True, kw_only=True)
class KeyMatch:
    """Which file key fills each parameter and buffer of the model, and what matched nothing."""

    params: dict[str, str]  # canonical parameter name -> file key
    buffers: dict[str, str]  # buffer name -> file key
    missing: tuple[str, ...]  # model names the file does not hold
    unexpected: tuple[str, ...]  # file keys no model name took
    adapters: tuple[str, ...]  # peft adapter parameters left to peft's initialisation


def match_keys(
    *, params: Iterable[ParamShard], buffers: Iterable[str], file_keys: Iterable[str], model: nn.Module
) -> KeyMatch:
    """Pair every parameter (under any of its tied names) and buffer of `model` with a file key."""
    hf = hf_model(model)
    prefix = getattr(hf, "base_model_prefix", "") or ""
    ignore_missing = _patterns(hf, "_keys_to_ignore_on_load_missing")
    ignore_unexpected = _patterns(hf, "_keys_to_ignore_on_load_unexpected")
    adapters = adapter_params(model)
    by_base: dict[str, str] = {}
    for key in file_keys:
        base = base_name(key)
        if base in by_base:
            raise ValueError(
                f"the weights hold both {by_base[base]!r} and {key!r}, which name the same parameter; keep one of them"
            )
        by_base[base] = key
    used: set[str] = set()

    def find(name: str) -> str | None:
        key = next((by_base[c] for c in _candidates(base_name(name), prefix) if c in by_base), None)
        if key is not None:
            used.add(key)
        return key

    matched_params, matched_buffers, missing, left = {}, {}, [], []
    for shard in params:
        found = [k for k in (find(n) for n in (shard.fqn, *shard.aliases)) if k is not None]
        if found:
            matched_params[shard.fqn] = found[0]
        elif shard.fqn in adapters:
            left.append(shard.fqn)
        elif not _ignored(shard.fqn, ignore_missing):
            missing.append(shard.fqn)
    for name in buffers:
        key = find(name)
        if key is not None:
            matched_buffers[name] = key
        elif not _ignored(name, ignore_missing):
            missing.append(name)
    unexpected = sorted(k for k in by_base.values() if k not in used and not _ignored(k, ignore_unexpected))
    return KeyMatch(
        params=matched_params,
        buffers=matched_buffers,
        missing=tuple(missing),
        unexpected=tuple(unexpected),
        adapters=tuple(left),
    )


def _candidates(base: str, prefix: str) -> list[str]:
    """The file names a model's base name may have: as is, then without or with the base-model prefix."""
    if not prefix:
        return [base]
    if base.startswith(prefix + "."):
        return [base, base[len(prefix) + 1 :]]
    return [base, f"{prefix}.{base}"]


def _patterns(hf: nn.Module | None, attr: str) -> list[str]:
    return list(getattr(hf, attr, None) or ())


def _ignored(name: str, patterns: list[str]) -> bool:
    return any(re.search(p, name) for p in patterns)
