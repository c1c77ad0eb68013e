"""The files of an exported Hugging Face folder: how tensors are split over them and what they are called.

As `save_pretrained` does: tensors in order, a new file whenever the next tensor would take the
current one past `max_shard_size` (a tensor larger than that gets a file of its own); one file is
`model.safetensors`, several are `model-0000i-of-0000n.safetensors` with a
`model.safetensors.index.json` mapping every tensor to its file. The split is decided from names,
shapes and dtypes alone, before any tensor exists, so every file's header is known up front and
the tensors can be streamed into it (a tensor over the limit is filed on its own while the file
being filled stays open, so a writer may have two files open at once).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.tensorfile import TensorSpec
from .files import INDEX_FILE, WEIGHTS_FILE

_DECIMAL = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_BINARY = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB" (10^9, as Hugging Face counts) or "4GiB" (2^30)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]I?B)\s*", size.upper())
        if match:
            try:
                value = float(match[1]) * {**_DECIMAL, **_BINARY}[match[2]]
            except ValueError:
                value = 0
            if value >= 1:
                return int(value)
    raise ValueError(f"max_shard_size={size!r}: give a positive number of bytes or a size such as '5GB' or '4GiB'")


@dataclass(frozen=True, kw_only=True)
class FilePlan:
    """One file of the export: its name and the tensors it holds, in the order they are written."""

    name: str
    specs: tuple[TensorSpec, ...]


def split_files(specs: list[TensorSpec], *, max_bytes: int, single_name: str = WEIGHTS_FILE) -> list[FilePlan]:
    """Cut `specs` (in order) into files of at most `max_bytes` each, named as transformers names them."""
    groups: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if spec.nbytes > max_bytes:
            groups.append([spec])
            continue
        if current and size + spec.nbytes > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current or not groups:
        groups.append(current)
    if len(groups) == 1:
        return [FilePlan(name=single_name, specs=tuple(groups[0]))]
    n = len(groups)
    return [FilePlan(name=f"model-{i + 1:05d}-of-{n:05d}.safetensors", specs=tuple(g)) for i, g in enumerate(groups)]


def index_of(files: list[FilePlan]) -> dict:
    """The `model.safetensors.index.json` content for a split export."""
    return {
        "metadata": {"total_size": sum(s.nbytes for f in files for s in f.specs)},
        "weight_map": {s.name: f.name for f in files for s in f.specs},
    }


def stale_files(directory: Path, written: list[FilePlan]) -> list[Path]:
    """Weights files of an earlier export in `directory` that this one does not replace (they would mislead
    a loader: transformers reads `model.safetensors` before an index)."""
    keep = {f.name for f in written} | ({INDEX_FILE} if len(written) > 1 else set())
    out = []
    for path in directory.iterdir() if directory.is_dir() else ():
        ours = path.name in (WEIGHTS_FILE, INDEX_FILE) or _SHARD_NAME.fullmatch(path.name)
        if ours and path.name not in keep and path.is_file():
            out.append(path)
    return out
