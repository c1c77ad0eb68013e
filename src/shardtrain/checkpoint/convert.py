"""Sharded checkpoint -> one full safetensors file, in a single process, one unit at a time.

No process group and no model code are needed: metadata.json says where every parameter's rows lie
in the shards. Each parameter is read whole from the shard files, written (tied weights under every
name, as the full format does) and freed, so memory stays at about one parameter. With a Hugging Face config (given, or recorded at save time for
a transformers model) the output is a folder `from_pretrained` opens: config.json + model.safetensors.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .commit import resolve
from .format import dtype_of, full_file, read_metadata, saved_params_kind
from .sharded import sharded_source
from .source import ModuleSource
from .tensorfile import CheckpointFiles, SafetensorsWriter, TensorSpec


@dataclass(frozen=True, kw_only=True)
class Converted:
    weights: Path  # the safetensors file written
    config: Path | None  # config.json, when a Hugging Face folder was written
    tensors: int


def convert_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    module: str | None = None,
    hf_config: str | os.PathLike | None = None,
) -> Converted:
    """Write module `module` (default: the only one) of a sharded checkpoint as full tensors.

    `out` ending in `.safetensors` is the file to write; otherwise `out` is a folder for
    `transformers` `from_pretrained`, which needs a config: `hf_config` (a config.json or a folder
    holding one) or the one the checkpoint recorded.
    """
    directory = resolve(checkpoint)
    metadata = read_metadata(directory)
    modules = metadata["modules"]
    if metadata["kind"] != "sharded":
        raise ValueError(
            f"{directory} is already a full checkpoint: its weights are the files "
            f"{[full_file(k) for k in modules]} there"
        )
    key = _pick_module(directory, modules, module)
    record = modules[key]
    out = Path(out)
    config = _read_config(hf_config) if hf_config is not None else record.get("hf_config")
    if out.suffix == ".safetensors" and hf_config is None:
        config = None
    elif config is None:
        raise ValueError(
            f"output {out} does not end in .safetensors and the checkpoint holds no Hugging Face config; "
            "name a .safetensors file, or pass --hf-config CONFIG_JSON to write a from_pretrained folder"
        )
    if config is not None and saved_params_kind(record) == "trainable":
        raise ValueError(
            f"{directory} holds only the trainable parameters of {key!r} (e.g. LoRA adapters), not a "
            "whole model for from_pretrained; convert them to a .safetensors file, or export the model "
            "with --run.export_hf true"
        )
    weights = out / "model.safetensors" if config is not None else out
    weights.parent.mkdir(parents=True, exist_ok=True)
    with CheckpointFiles(directory, metadata["files"]) as files:
        count = _write_weights(sharded_source(files, key, record, version=metadata["version"]), record, weights)
    config_path = None
    if config is not None:
        config_path = out / "config.json"
        # The weights are never quantised: a quantization_config (of a model loaded from a bitsandbytes
        # folder) would make from_pretrained quantise them again.
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return Converted(weights=weights, config=config_path, tensors=count)


def _write_weights(source: ModuleSource, record: dict[str, Any], weights: Path) -> int:
    names = [(fqn, (fqn, *aliases)) for fqn, aliases in source.params]
    specs = [
        TensorSpec(name=name, dtype=source.param_dtypes[fqn], shape=source.param_shapes[fqn])
        for fqn, every in names
        for name in every
    ]
    specs += [
        TensorSpec(name=n, dtype=dtype_of(b["dtype"]), shape=tuple(b["shape"])) for n, b in record["buffers"].items()
    ]
    partial = weights.with_name(f".{weights.name}.partial")
    writer = SafetensorsWriter(partial, specs)
    for fqn, every in names:
        shape = source.param_shapes[fqn]
        whole = source.read_param(fqn, 0, math.prod(shape)).view(shape)
        for name in every:
            writer.write(name, whole)
        del whole
    for name in record["buffers"]:
        writer.write(name, source.read_buffer(name))
    writer.close()
    os.replace(partial, weights)
    return len(specs)


def _pick_module(directory: Path, modules: dict[str, Any], module: str | None) -> str:
    if module is not None:
        if module not in modules:
            raise ValueError(f"module {module!r} is not in {directory}; it holds {sorted(modules)}")
        return module
    if len(modules) != 1:
        raise ValueError(f"{directory} holds {len(modules)} sharded modules {sorted(modules)}; pick one with --module")
    return next(iter(modules))


def _read_config(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"--hf-config {path}: cannot read a JSON config ({exc}); pass a config.json or a folder holding one"
        ) from None
