"""Streaming safetensors writer and verified readers of a checkpoint's files.

The writer emits a file tensor by tensor: the header (names, dtypes, shapes, offsets) is known from
the layouts before any data exists, so a caller can gather one unit, write it and free it, and a
full checkpoint of a large model never needs more than one unit in host memory. It hashes the bytes
as it writes them, so the metadata can record every file's sha256 without reading it back.

Readers check each file against the size and digest in metadata.json before opening it: a truncated
or altered file fails with a clear error instead of loading garbage. Writers report an I/O error
(a full disk, a read-only directory) as one line naming the file and the remedy.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import pickle
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .format import dtype_code

_CHUNK = 64 << 20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class CheckpointWriteError(OSError):
    """Writing a checkpoint file failed; the message names the path and the remedy."""


@contextlib.contextmanager
def writing(path: Path):
    """Within this block, an OSError becomes a `CheckpointWriteError` naming `path` (kept as is when an
    inner block already named a more precise path)."""
    try:
        yield
    except CheckpointWriteError:
        raise
    except OSError as exc:
        reason, remedy = io_failure(exc)
        raise CheckpointWriteError(
            exc.errno, f"could not write {path}: {reason}; {remedy} (the last committed checkpoint is untouched)"
        ) from exc


def io_failure(exc: OSError) -> tuple[str, str]:
    """(what went wrong, what to do) for an I/O error while writing a checkpoint."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    remedy = (
        "free space on that filesystem or save to a directory on another one"
        if exc.errno in _NO_SPACE
        else "check that the directory exists and is writable, or save to another directory"
    )
    return reason, remedy


@dataclass(frozen=True, kw_only=True)
class FileRecord:
    """What metadata.json records of one file, to detect truncation and corruption on load."""

    bytes: int
    sha256: str

    @staticmethod
    def of(path: Path) -> FileRecord:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        return FileRecord(bytes=path.stat().st_size, sha256=digest.hexdigest())


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SafetensorsWriter:
    """Write the tensors declared in `specs`, in that order, one `write` call each."""

    def __init__(self, path: Path, specs: Sequence[TensorSpec], *, metadata: dict[str, str] | None = None) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for spec in specs:
            if spec.name in header:
                raise ValueError(f"tensor name {spec.name!r} appears twice in {path.name}")
            header[spec.name] = {
                "dtype": dtype_code(spec.dtype),
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
        self.path = path
        self._specs = list(specs)
        self._next = 0
        self._digest = hashlib.sha256()
        with writing(path):
            self._file = open(path, "wb")
        self._emit(struct.pack("<Q", len(raw)) + raw)

    def _emit(self, data) -> None:
        self._digest.update(data)
        with writing(self.path):
            self._file.write(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self._specs[self._next]
        if name != spec.name or tensor.dtype != spec.dtype or tensor.numel() != math.prod(spec.shape):
            raise RuntimeError(
                f"{self.path.name}: expected tensor {spec.name!r} {spec.dtype} {spec.shape}, got "
                f"{name!r} {tensor.dtype} {tuple(tensor.shape)}"
            )
        self._next += 1
        if tensor.numel():
            flat = tensor.detach().reshape(-1).cpu()
            if flat.stride(0) != 1:
                # Note: `contiguous()` keeps a one-element view of any stride (a gathered one-row
                # parameter), which cannot be viewed as bytes; a copy has stride 1.
                flat = flat.clone(memory_format=torch.contiguous_format)
            self._emit(memoryview(flat.view(torch.uint8).numpy()))  # type: ignore[arg-type]  # numpy's stubs

    def close(self) -> FileRecord:
        """Flush to disk (fsync) and return the file's record."""
        if self._next != len(self._specs):
            raise RuntimeError(f"{self.path.name}: closed after {self._next} of {len(self._specs)} tensors")
        with writing(self.path):
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        return FileRecord(bytes=self.path.stat().st_size, sha256=self._digest.hexdigest())


class CheckpointFiles:
    """The files of one checkpoint, each checked against metadata.json the first time it is opened."""

    def __init__(self, root: Path, records: dict[str, dict[str, Any]]) -> None:
        self.root = root
        self._records = records
        self._stack = contextlib.ExitStack()
        self._open: dict[str, Any] = {}

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def verified(self, name: str) -> Path:
        path = self.root / name
        record = self._records.get(name)
        if record is None:
            raise ValueError(
                f"{self.root} does not list {name} in its metadata; the checkpoint is incomplete or "
                "was edited: load an earlier checkpoint"
            )
        if not path.is_file():
            raise ValueError(f"{path} is missing; the checkpoint is incomplete: load an earlier checkpoint")
        size = path.stat().st_size
        if size != record["bytes"]:
            raise ValueError(
                f"{path} is truncated or altered: {size} bytes, the metadata says {record['bytes']}; "
                "load an earlier checkpoint"
            )
        digest = FileRecord.of(path).sha256
        if digest != record["sha256"]:
            raise ValueError(
                f"{path} is corrupt: sha256 {digest} differs from {record['sha256']} in the metadata; "
                "load an earlier checkpoint"
            )
        return path

    def tensors(self, name: str):
        """An open safetensors handle (`get_slice`, `get_tensor`) on a verified file."""
        if name not in self._open:
            path = self.verified(name)
            try:
                self._open[name] = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except SafetensorError as exc:
                raise ValueError(
                    f"{path} is not a readable safetensors file ({exc}); load an earlier checkpoint"
                ) from None
        return self._open[name]

    def torch_file(self, name: str) -> Any:
        """A torch file read with `weights_only=True`: tensors and primitives, never code."""
        path = self.verified(name)
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            blocked = re.search(r"GLOBAL (\S+)", str(exc))
            what = f"a pickled {blocked[1]}" if blocked else "pickled objects"
            raise ValueError(
                f"{path} holds {what}, where a checkpoint holds only tensors and primitives: the file is "
                "untrusted and cannot be loaded safely; load a checkpoint written by "
                "st.save_checkpoint"
            ) from None


def read_flat(handle, name: str, start: int, numel: int) -> torch.Tensor:
    """Elements `[start, start + numel)` of tensor `name` flattened, reading only the rows they span."""
    view = handle.get_slice(name)
    shape = view.get_shape()
    if not shape:
        return handle.get_tensor(name).reshape(-1)[start : start + numel]
    row = math.prod(shape[1:])
    if numel == 0 or row == 0:
        return view[0:0].reshape(-1)
    first, last = start // row, -(-(start + numel) // row)
    rows = view[first:last].reshape(-1)
    begin = start - first * row
    return rows[begin : begin + numel]
