"""The on-disk format: names, version, the metadata file, and the unit layouts it records.

A checkpoint is a directory holding `metadata.json` (written last, by rank 0) and the tensor and
object files it lists with their byte sizes and sha256 digests. docs/checkpoint-format.md describes
every field; this module is the one place that knows file and tensor names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..core.flat import FlatLayout, ParamSlot
from ..core.unit import ShardUnit

FORMAT_NAME = "shardtrain-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
LATEST_FILE = "latest"
KINDS = ("sharded", "full")

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
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


def param_tensor(unit: int) -> str:
    return f"param.{unit}"


def state_tensor(optimizer: str, key: str, unit: int) -> str:
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
def unit_record(unit: ShardUnit) -> dict[str, Any]:
    layout = unit.layout
    return {
        "name": unit.name,
        "dtype": dtype_code(unit.shard.dtype),
        "numel": layout.numel,
        "padded_numel": layout.padded_numel,
        "shard_numel": layout.shard_numel,
        "slots": [
            {"fqn": s.fqn, "shape": list(s.shape), "dtype": dtype_code(s.dtype), "offset": s.offset,
             "requires_grad": s.requires_grad, "aliases": list(s.aliases)}
            for s in layout.slots
        ],
    }


def layout_of(record: dict[str, Any], shard_world: int) -> FlatLayout:
    """The saved unit's layout, as the shards were cut at save time."""
    slots = tuple(
        ParamSlot(fqn=s["fqn"], shape=tuple(s["shape"]), dtype=dtype_of(s["dtype"]), offset=s["offset"],
                  requires_grad=s["requires_grad"], aliases=tuple(s["aliases"]))
        for s in record["slots"]
    )
    return FlatLayout(slots=slots, shard_world=shard_world)


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
        raise ValueError(f"{directory} is not a checkpoint: it has no {METADATA_FILE}; pass a directory written "
                         "by st.save_checkpoint (or the directory holding its 'latest' pointer)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is corrupt ({exc}); load an earlier checkpoint") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        found = metadata.get("format") if isinstance(metadata, dict) else type(metadata).__name__
        raise ValueError(f"{path} is not a shardtrain checkpoint (format {found!r}, expected {FORMAT_NAME!r})")
    version = metadata.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(f"{directory} has checkpoint format version {version!r}, newer than the version "
                         f"{FORMAT_VERSION} this shardtrain reads; upgrade shardtrain to load it")
    if metadata.get("kind") not in KINDS:
        raise ValueError(f"{path} has unknown kind {metadata.get('kind')!r}; expected one of {KINDS}")
    return metadata


def created_ns(directory: Path) -> int | None:
    """When the checkpoint in `directory` was written (ns since the epoch); None if it is not one."""
    try:
        metadata = json.loads((directory / METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        return None
    return int(metadata.get("created_ns", 0))
