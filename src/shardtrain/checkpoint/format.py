"""The on-disk format: names, version, the metadata file, and the unit layouts it records.

A checkpoint is a directory holding `metadata.json` (written last, by rank 0) and the tensor and
object files it lists with their byte sizes and sha256 digests. docs/checkpoint-format.md describes
every field; this module is the one place that knows file and tensor names.

Version 2 stores each parameter's rows per shard under its name (`param.<fqn>`); version 1 stored
one flat tensor per unit (`param.<unit>`) and still loads (`legacy_*`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from ..core.held import held_params
from ..core.runtime import Runtime
from ..tp.boxes import SPLITS

FORMAT_NAME = "shardtrain-checkpoint"
FORMAT_VERSION = 2
METADATA_FILE = "metadata.json"
LATEST_FILE = "latest"
KINDS = ("sharded", "full")
PARAMS = ("all", "trainable")  # which parameters a module record (and its files) holds

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_BY_CODE = {code: dtype for dtype, code in _DTYPES.items()}


# ------------------------------------------------------------------------------------ names
def shard_file(module: str, shard: int, shards: int) -> str:
    """Sharded format: shard `shard` of module `module` (its flat params and optimizer state)."""
    return f"{module}-{shard:05d}-of-{shards:05d}.safetensors"


def full_file(key: str) -> str:
    """Full format: the module (or optimizer state) of state key `key` as one safetensors file."""
    return f"{key}.safetensors"


def rank_file(rank: int) -> str:
    """Per-rank torch file: the state dicts of the plain objects and the random-number generators."""
    return f"rank-{rank:05d}.pt"


def param_tensor(fqn: str) -> str:
    """Sharded format: this shard's rows of parameter `fqn`."""
    return f"param.{fqn}"


def state_tensor(optimizer: str, key: str, fqn: str) -> str:
    """Sharded format: this shard's rows of elementwise state `key` of `fqn` in optimizer `optimizer`."""
    return f"optim.{optimizer}.{key}.{fqn}"


def legacy_param_tensor(unit: int) -> str:
    """Version 1: the flat shard of unit `unit`."""
    return f"param.{unit}"


def legacy_state_tensor(optimizer: str, key: str, unit: int) -> str:
    return f"optim.{optimizer}.{key}.{unit}"


def buffer_tensor(name: str) -> str:
    return f"buffer.{name}"


def full_state_tensor(fqn: str, key: str) -> str:
    return f"state.{fqn}.{key}"


def short_list(names: list[str], limit: int = 8) -> str:
    """`names` for an error message, cut after `limit` entries."""
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return f"[{', '.join(names[:limit])}{more}]"


# ------------------------------------------------------------------------------------ dtypes
def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code of `dtype` (also used in metadata.json)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be stored in a checkpoint; supported: {sorted(map(str, _DTYPES))}")
    return _DTYPES[dtype]


def dtype_of(code: str) -> torch.dtype:
    return _BY_CODE[code]


# ------------------------------------------------------------------------------------ layouts
def params_record(runtime: Runtime, *, params: str = "all") -> list[dict[str, Any]]:
    """The parameters of a sharded module that are saved (`params`: "all", or "trainable": those that
    require gradients), in unit order: name, aliases, global shape, stored dtype, unit, and under
    tensor parallelism how it is split ("rows" / "cols")."""
    records = []
    for h in held_params(runtime):
        s = h.layout
        if not saves(s.requires_grad, params):
            continue
        record = {
            "fqn": s.fqn,
            "aliases": list(s.aliases),
            "shape": list(h.shape),
            "dtype": dtype_code(s.dtype),
            "requires_grad": s.requires_grad,
            "unit": h.unit.name,
        }
        if h.split is not None:
            record["split"] = h.split  # tensor parallelism: tp/boxes.py, docs/checkpoint-format.md
        records.append(record)
    return records


def saves(requires_grad: bool, params: str) -> bool:
    """Whether a parameter is saved when saving `params` ("all" or "trainable")."""
    return params == "all" or requires_grad


def saved_params_kind(record: dict[str, Any]) -> str:
    """Which parameters a module record holds: "all" (also every checkpoint written before the choice
    existed) or "trainable"."""
    return record.get("saved", "all")


# ------------------------------------------------------------------------------------ metadata file
def write_metadata(directory: Path, metadata: dict[str, Any]) -> None:
    path = directory / METADATA_FILE
    with open(path, "w", encoding="utf-8") as f:
        json.dump(metadata, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_metadata(directory: Path) -> dict[str, Any]:
    """Parse and check `metadata.json`: our format, a version this code reads, a known kind."""
    path = directory / METADATA_FILE
    try:
        metadata = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"{directory} is not a checkpoint: it has no {METADATA_FILE}; pass a directory written "
            "by st.save_checkpoint (or the directory holding its 'latest' pointer)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is corrupt ({exc}); load an earlier checkpoint") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        found = metadata.get("format") if isinstance(metadata, dict) else type(metadata).__name__
        raise ValueError(f"{path} is not a shardtrain checkpoint (format {found!r}, expected {FORMAT_NAME!r})")
    version = metadata.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(
            f"{directory} has checkpoint format version {version!r}, newer than the version "
            f"{FORMAT_VERSION} this shardtrain reads; upgrade shardtrain to load it"
        )
    if metadata.get("kind") not in KINDS:
        raise ValueError(f"{path} has unknown kind {metadata.get('kind')!r}; expected one of {KINDS}")
    for key, record in metadata.get("modules", {}).items():
        _check_module_record(path, key, record, version)
    return metadata


def _check_module_record(path: Path, key: str, record: dict[str, Any], version: int) -> None:
    """The layout a module record describes must be consistent, so that an edited file cannot load wrong values."""
    where = f"{path}: module {key!r}"
    if not isinstance(key, str) or not key or any(c in key for c in "/\\") or key.startswith("."):
        raise ValueError(
            f"{where} is not a plain name (it would name a file outside the checkpoint); the metadata "
            "was edited or damaged: load an earlier checkpoint"
        )
    try:
        shard_world = record["shard_world"]
        if not isinstance(shard_world, int) or shard_world < 1:
            raise ValueError(f"shard_world={shard_world!r} is not a positive int")
        tp_world = record.get("tp_world", 1)
        if not isinstance(tp_world, int) or tp_world < 1:
            raise ValueError(f"tp_world={tp_world!r} is not a positive int")
        if version >= 2:
            for p in record["params"]:
                if not all(isinstance(d, int) and d >= 0 for d in p["shape"]):
                    raise ValueError(f"parameter {p['fqn']!r} has shape {p['shape']!r}")
                if p.get("split") not in (None, *SPLITS) or (p.get("split") == "cols" and len(p["shape"]) < 2):
                    raise ValueError(f"parameter {p['fqn']!r} has split {p.get('split')!r}")
                dtype_of(p["dtype"])
        else:
            for u, unit in enumerate(record["units"]):
                _check_legacy_unit(u, unit, shard_world)
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"{where} is malformed ({type(exc).__name__}: {exc}); the metadata was edited or damaged: "
            "load an earlier checkpoint"
        ) from None
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}; the metadata was edited or damaged: load an earlier checkpoint") from None


def _check_legacy_unit(u: int, unit: dict[str, Any], shard_world: int) -> None:
    """Version 1: the slots tile the unit's flat buffer back to back and the sizes add up."""
    offset = 0
    for slot in unit["slots"]:
        numel = math.prod(slot["shape"])
        if slot["offset"] != offset:
            raise ValueError(
                f"unit {u} slot {slot['fqn']!r} starts at {slot['offset']}, expected {offset} "
                "(slots must tile the flat buffer)"
            )
        offset += numel
    if unit["numel"] != offset:
        raise ValueError(f"unit {u} numel {unit['numel']} differs from its slots' total {offset}")
    shard_numel = -(-offset // shard_world)
    if unit["shard_numel"] != shard_numel or unit["padded_numel"] != shard_numel * shard_world:
        raise ValueError(
            f"unit {u} shard_numel {unit['shard_numel']} / padded_numel {unit['padded_numel']} do not "
            f"match {offset} elements over {shard_world} shards"
        )


def created_ns(directory: Path) -> int | None:
    """When the checkpoint in `directory` was written (ns since the epoch); None if it is not one."""
    try:
        metadata = json.loads((directory / METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        return None
    return int(metadata.get("created_ns", 0))
