"""Which safetensors files hold a pretrained model, and what each tensor in them is.

A path names one `.safetensors` file, a `model.safetensors.index.json`, or a Hugging Face model
folder holding either `model.safetensors` or that index with the files it lists. Only the headers
are read here (names, shapes, dtypes; and the few bytes of each bitsandbytes quant state, which give
a quantised weight's true shape): cheap enough for every rank to do, so that every rank checks the
same things and fails the same way before any weight is read. Only safetensors are accepted: a
pickled `pytorch_model.bin` can run code when loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from ..checkpoint.format import dtype_of
from .bnb_layout import group

if TYPE_CHECKING:
    from .bnb_layout import Packed

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_ADAPTER = "adapter_model.safetensors"


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """One tensor of a weights file: its key, the file holding it, its shape and dtype. A weight stored
    quantised by bitsandbytes is one entry of its true shape and dtype, `packed` saying how to read it."""

    key: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    packed: Packed | None = None


@dataclass(frozen=True, kw_only=True)
class WeightFiles:
    """The tensors of a pretrained model, by key, and the path they were found from."""

    path: Path  # what the caller named
    files: tuple[Path, ...]
    tensors: dict[str, TensorEntry]

    @property
    def folder(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent


def weights_in_folder(folder: Path) -> Path | None:
    """The single weights file or the index of a model folder (in that order, as transformers looks)."""
    for name in (WEIGHTS_FILE, INDEX_FILE):
        if (folder / name).is_file():
            return folder / name
    return None


def resolve_weights(path: str | os.PathLike) -> WeightFiles:
    """Find and read the headers of the weights at `path` (a bitsandbytes-quantised weight and its
    companion tensors as one entry: bnb_layout.py); ValueError naming the file and the fix."""
    given = Path(path).expanduser()
    if not given.exists():
        raise ValueError(
            f"{given} does not exist; pass a .safetensors file or a Hugging Face model folder "
            f"holding {WEIGHTS_FILE} or {INDEX_FILE}"
        )
    target = weights_in_folder(given) if given.is_dir() else given
    if target is None:
        raise ValueError(_no_weights(given))
    if target.name.endswith(".index.json"):
        files, keys = _read_index(target)
    elif target.suffix == ".safetensors":
        files, keys = (target,), None
    else:
        raise ValueError(
            f"{target} is neither a .safetensors file nor a {INDEX_FILE}; shardtrain reads safetensors "
            "weights only (pickled .bin files can run code): re-save the model with save_pretrained"
        )
    tensors: dict[str, TensorEntry] = {}
    for file in files:
        for entry in _read_header(file):
            if keys is not None and keys.get(entry.key) != file:
                continue  # the index places this key in another file (or nowhere): transformers ignores it here
            if entry.key in tensors:
                raise ValueError(
                    f"{file}: tensor {entry.key!r} is also in {tensors[entry.key].file}; a model's files "
                    "hold each tensor once: remove the duplicate file"
                )
            tensors[entry.key] = entry
    if keys is not None:
        absent = sorted(k for k in keys if k not in tensors)
        if absent:
            raise ValueError(
                f"{target} maps {absent[0]!r} to {keys[absent[0]].name}, which does not hold it "
                f"({len(absent)} such key(s)); the index and its files disagree: re-save the model"
            )
    return WeightFiles(path=given, files=files, tensors=group(tensors, folder=target.parent))


def _no_weights(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir())
    if any(n in names for n in _PICKLES):
        return (
            f"{folder} holds only pickled PyTorch weights ({', '.join(n for n in _PICKLES if n in names)}); "
            "shardtrain reads safetensors only (a pickle can run code): re-save the model with save_pretrained"
        )
    if _ADAPTER in names:
        return (
            f"{folder} is a PEFT adapter ({_ADAPTER}), not a model; pass the base model's folder (the adapter "
            "is trained by --lora.* options)"
        )
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "nothing"
    return (
        f"{folder} holds no {WEIGHTS_FILE} or {INDEX_FILE} (it holds {shown}); pass a Hugging Face model folder "
        "written by save_pretrained, or a .safetensors file"
    )


def _read_index(index: Path) -> tuple[tuple[Path, ...], dict[str, Path]]:
    """The files an index lists and the file of each key; every file must exist inside its folder."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{index} is not a readable JSON index ({exc}); re-save the model with save_pretrained"
        ) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(
            f"{index} has no 'weight_map' of tensor name -> file name; re-save the model with save_pretrained"
        )
    files: dict[str, Path] = {}
    for name in weight_map.values():
        if name in files:
            continue
        if Path(name).name != name or name in (".", ".."):
            raise ValueError(
                f"{index} names file {name!r}, which is not a plain file name in its folder; the index "
                "is damaged: re-save the model"
            )
        file = index.parent / name
        if not file.is_file():
            raise ValueError(f"{index} lists {name}, which is missing from {index.parent}; copy the whole model folder")
        files[name] = file
    return tuple(files.values()), {key: files[name] for key, name in weight_map.items()}


def _read_header(file: Path) -> list[TensorEntry]:
    """Every tensor's key, shape and dtype from the header of `file` (no tensor data is read)."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            out = []
            for key in handle.keys():
                view = handle.get_slice(key)
                shape = tuple(view.get_shape())
                out.append(TensorEntry(key=key, file=file, shape=shape, dtype=_dtype(file, key, view)))
            return out
    except (SafetensorError, OSError) as exc:
        raise ValueError(
            f"{file} is not a readable safetensors file ({exc}); the file is damaged or truncated: copy it again"
        ) from None


def _dtype(file: Path, key: str, view) -> torch.dtype:
    code = view.get_dtype()
    try:
        return dtype_of(code)
    except KeyError:
        raise ValueError(
            f"{file}: tensor {key!r} has dtype {code}, which shardtrain does not load; convert the "
            "model to float32, bfloat16 or float16"
        ) from None
