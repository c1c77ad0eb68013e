"""Build the model to train from its name: a built-in Llama size, a Hugging Face causal LM, or a factory.

`llama-<size>` (built on the meta device, so even 8B starts instantly; st.shard materialises it unit
by unit); `hf`, a transformers causal LM from model.hf_config / model.kwargs, randomly initialised
(nothing is downloaded); `model.pretrained DIR`, the same from DIR/config.json on the meta device, its
weights loaded after sharding (train/finetune.py; a Hub id was fetched to a DIR by train/hub_inputs.py);
`package.module:factory`, called with model.kwargs. Each comes with its default sharding units: Llama's
`default_units`, else the model's `_no_split_modules` (the blocks its authors say must not be split),
else the whole model as one unit.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models.llama import LLAMA_SIZES, Llama, LlamaConfig, default_units, llama_config
from ..policy import classes_named
from .sections import ModelConfig

LLAMA_PREFIX = "llama-"


@dataclass(frozen=True, kw_only=True)
class BuiltModel:
    module: nn.Module
    wrap: frozenset[type[nn.Module]] | None  # None: the whole model is one unit
    description: str
    max_seq_len: int | None  # longest sequence the model accepts, where it has a limit
    notice: str | None = None  # something the user must be told (printed by rank 0)


def model_names() -> list[str]:
    return [LLAMA_PREFIX + size for size in LLAMA_SIZES] + ["hf", "package.module:factory"]


def build_model(cfg: ModelConfig, *, init_context, dtype: torch.dtype = torch.float32) -> BuiltModel:
    """Build the model named by `cfg.name`; raise ValueError with the fix if it cannot be built.

    `init_context(empty_init=...)` is the engine's `init_module`: models that can initialise
    themselves on the meta device (the built-in Llama) are built there, and so is a `model.pretrained`
    model (in `dtype`), whose weights are loaded after sharding.
    """
    name = cfg.name
    try:
        if cfg.pretrained is not None:
            built = _build_pretrained(cfg, dtype=dtype)
        elif name.lower().startswith(LLAMA_PREFIX):
            built = _build_llama(name[len(LLAMA_PREFIX) :], cfg.kwargs, init_context)
        elif name == "hf":
            built = _build_hf(cfg)
        elif ":" in name:
            built = _build_factory(name, cfg.kwargs)
        else:
            raise ValueError(f"use one of {', '.join(model_names())}")
    except ValueError as exc:
        what = f"model.pretrained={cfg.pretrained!r}" if cfg.pretrained is not None else f"model.name={name!r}"
        raise ValueError(f"{what} does not build: {exc}") from exc
    if cfg.wrap:
        built = dataclasses.replace(built, wrap=classes_named(built.module, cfg.wrap, what="model.wrap"))
    return built


def _build_llama(size: str, kwargs: dict[str, Any], init_context) -> BuiltModel:
    if size.lower() not in LLAMA_SIZES:
        raise ValueError(
            f"unknown Llama size {size!r}; built-in sizes: {', '.join(LLAMA_PREFIX + s for s in LLAMA_SIZES)}"
        )
    _check_llama_kwargs(kwargs)
    try:
        cfg = llama_config(size, **kwargs)
    except TypeError as exc:
        fields = ", ".join(f.name for f in dataclasses.fields(LlamaConfig))
        raise ValueError(f"model.kwargs={kwargs!r}: {exc}; LlamaConfig fields are {fields}") from exc
    with init_context(empty_init=True):
        module = Llama(cfg)
    return BuiltModel(
        module=module,
        wrap=default_units(cfg),
        max_seq_len=cfg.max_seq_len,
        description=f"Llama {size} ({cfg.num_params() / 1e6:.2f}M params, {cfg.n_layers} layers, dim {cfg.dim})",
    )


def _check_llama_kwargs(kwargs: dict[str, Any]) -> None:
    """Each override of a LlamaConfig field must have the field's type (and sizes be positive), so a typo
    such as `--model.kwargs.n_layers abc` fails here, naming the key, not deep inside the model."""
    hints = typing.get_type_hints(LlamaConfig)
    defaults = {f.name: f.default for f in dataclasses.fields(LlamaConfig)}
    for key, value in kwargs.items():
        tp = hints.get(key)
        if tp is bool:
            ok = isinstance(value, bool)
        elif tp is int:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        elif tp is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        else:
            continue  # not a field: llama_config names the valid ones
        if not ok:
            kind = {bool: "true or false", int: "a positive integer", float: "a positive finite number"}[tp]
            raise ValueError(
                f"model.kwargs.{key}={value!r} must be {kind} (LlamaConfig.{key}); "
                f"e.g. --model.kwargs.{key} {str(defaults[key]).lower()}"
            )


def _transformers():
    try:
        import transformers
    except ModuleNotFoundError as exc:
        raise ValueError("Hugging Face models need transformers: pip install 'shardtrain[hf]'") from exc
    return transformers


def _build_pretrained(cfg: ModelConfig, *, dtype: torch.dtype) -> BuiltModel:
    """The model of a Hugging Face folder, from its config.json, on the meta device (weights come later)."""
    from ..data.hub import is_hub_id
    from ..pretrained.files import CONFIG_FILE, weights_in_folder

    if cfg.name not in ("hf", ModelConfig.name):
        raise ValueError(
            f"it builds the Hugging Face model its config.json describes; drop --model.name {cfg.name} "
            "(or pass --model.name hf)"
        )
    if cfg.hf_config is not None:
        raise ValueError("the model's config is the folder's config.json; drop model.hf_config")
    path = Path(cfg.pretrained).expanduser()
    if is_hub_id(cfg.pretrained):
        raise ValueError(
            "it is a Hub model id, which shardtrain train fetches but this command reads only local folders; "
            f"download it (hf download {cfg.pretrained}) and pass the folder it prints"
        )
    if not path.is_dir() or not (path / CONFIG_FILE).is_file():
        raise ValueError(
            f"{path} is not a Hugging Face model folder with a {CONFIG_FILE}; pass the folder "
            "save_pretrained wrote, or a Hub model id (org/name)"
        )
    if weights_in_folder(path) is None:
        raise ValueError(
            f"{path} holds a {CONFIG_FILE} but no model.safetensors or model.safetensors.index.json; "
            "to train from random initialisation use --model.hf_config instead"
        )
    transformers = _transformers()
    hf_cfg = transformers.AutoConfig.from_pretrained(str(path), **cfg.kwargs)
    with torch.device("meta"):
        built = _from_config(transformers, hf_cfg, dtype=dtype)
    return dataclasses.replace(built, description=built.description.replace("from config", f"pretrained, {path}"))


def _build_hf(cfg: ModelConfig) -> BuiltModel:
    from ..pretrained.files import weights_in_folder

    transformers = _transformers()
    kwargs = dict(cfg.kwargs)
    notice = None
    if cfg.hf_config is not None:
        path = Path(cfg.hf_config).expanduser()
        if not path.exists():
            raise ValueError(
                f"model.hf_config={cfg.hf_config!r} does not exist; pass a local config.json or a "
                "directory holding one (nothing is downloaded)"
            )
        folder = path if path.is_dir() else path.parent
        weights = weights_in_folder(folder)
        if weights is not None:
            notice = (
                f"model.hf_config {path} sits beside weights ({weights.name}); training starts from random "
                f"initialisation, as model.hf_config asks: pass --model.pretrained {folder} to fine-tune from "
                "them"
            )
        hf_cfg = transformers.AutoConfig.from_pretrained(str(path), **kwargs)
    elif "model_type" in kwargs:
        hf_cfg = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    else:
        raise ValueError("give model.hf_config (a config.json) or model.kwargs.model_type (e.g. 'llama')")
    return dataclasses.replace(_from_config(transformers, hf_cfg), notice=notice)


def _from_config(transformers, hf_cfg, *, dtype: torch.dtype | None = None) -> BuiltModel:
    try:
        module = transformers.AutoModelForCausalLM.from_config(hf_cfg, **({"dtype": dtype} if dtype else {}))
    except Exception as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}".replace("\n", " ")) from exc
    wrap = _no_split_units(module)
    params = sum(p.numel() for p in module.parameters())
    return BuiltModel(
        module=module,
        wrap=wrap,
        max_seq_len=getattr(hf_cfg, "max_position_embeddings", None),
        description=f"{type(module).__name__} ({params / 1e6:.2f}M params, from config)",
    )


def _build_factory(spec: str, kwargs: dict[str, Any]) -> BuiltModel:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"cannot import {attr!r} from {module_name!r} ({exc}); check the module is on the "
            "Python path and the name after ':' exists"
        ) from exc
    try:
        module = factory(**kwargs)
    except Exception as exc:
        raise ValueError(f"{spec}(**{kwargs!r}) raised {type(exc).__name__}: {exc}".replace("\n", " ")) from exc
    if not isinstance(module, nn.Module):
        raise ValueError(f"{spec} returned {type(module).__name__}, not an nn.Module")
    params = sum(p.numel() for p in module.parameters())
    return BuiltModel(
        module=module,
        wrap=_no_split_units(module),
        max_seq_len=None,
        description=f"{type(module).__name__} ({params / 1e6:.2f}M params, from {spec})",
    )


def _no_split_units(module: nn.Module) -> frozenset[type[nn.Module]] | None:
    """The classes the model's `_no_split_modules` names (its authors' blocks), or None when it names none."""
    no_split = getattr(module, "_no_split_modules", None)
    return classes_named(module, no_split, what=f"{type(module).__name__}._no_split_modules") if no_split else None
