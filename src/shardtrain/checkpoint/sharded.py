"""Sharded format: each shard written once by the rank that holds it, read back at any world size.

Per sharded module and shard rank s (of S), one safetensors file holds, for every parameter `fqn`,
the rows shard s holds (`param.<fqn>`: rows `[s * ceil(R / S), ...)` of its R rows, the real rows
only) and, per optimizer over the module and elementwise state key k, `optim.<opt>.<k>.<fqn>` of the
same shape; a 0-dim parameter lives in shard 0, as do the buffers. No communication: every rank
writes what it holds, and a replica (hybrid_shard, no_shard) that is not the first writes nothing.

Reading a range of one flattened parameter takes the overlapping rows of the old shards' files
(safetensors reads slices without loading the rest), so any saved world size loads at any current
one. Every tensor's shape in a file is checked against the one the metadata implies before use.
Checkpoints of format version 1 (one flat tensor per unit) load through `LegacyShardedSource`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..core.held import held_params, tp_coordinates
from ..core.shard_module import runtime_of
from ..tp.boxes import Box, held_box, stores
from .entries import Entries
from .format import (
    buffer_tensor,
    legacy_param_tensor,
    legacy_state_tensor,
    param_tensor,
    saves,
    shard_file,
    state_tensor,
)
from .optim_state import OptimizerSnapshot
from .source import ModuleSource
from .tensorfile import CheckpointFiles, FileRecord, SafetensorsWriter, TensorSpec
from .this_rank import persistent_buffers, writes_shards


def write_shards(
    entries: Entries, snapshots: dict[str, OptimizerSnapshot], staging: Path, *, params: str = "all"
) -> dict[str, FileRecord]:
    """Write this rank's shard files (if it is in the first replica); return their records. `params`:
    "all", or "trainable" for only the parameters that require gradients."""
    records = {}
    for key, module in entries.modules.items():
        runtime = runtime_of(module)
        if not writes_shards(runtime):
            continue
        shard = runtime.comm.shard_rank
        tp_rank, tp_world = tp_coordinates(runtime)
        states = [(name, k, snap) for name, snap in snapshots.items() if snap.module == key for k in snap.elementwise]
        buffers = persistent_buffers(module) if shard == 0 and tp_rank == 0 else {}
        tensors: list[tuple[TensorSpec, Any]] = []
        for h in held_params(runtime):
            if not saves(h.requires_grad, params):
                continue
            # every rank holds a 0-dim parameter whole, every tp rank a replicated one: one of them stores it
            if not stores(h.layout.shape, split=h.split, dp_rank=shard, tp_rank=tp_rank):
                continue
            held = h.local
            tensors.append((TensorSpec(name=param_tensor(h.name), dtype=held.dtype, shape=tuple(held.shape)), held))
            for name, k, snap in states:
                piece = snap.piece(h.name, k)
                if piece is not None:
                    spec = TensorSpec(name=state_tensor(name, k, h.name), dtype=piece.dtype, shape=tuple(piece.shape))
                    tensors.append((spec, piece))
        tensors += [
            (TensorSpec(name=buffer_tensor(n), dtype=b.dtype, shape=tuple(b.shape)), b) for n, b in buffers.items()
        ]
        file = shard_file(key, shard * tp_world + tp_rank, runtime.comm.shard_world * tp_world)
        writer = SafetensorsWriter(staging / file, [spec for spec, _ in tensors])
        for spec, tensor in tensors:
            writer.write(spec.name, tensor)
        records[file] = writer.close()
    return records


def module_files(key: str, shard_world: int, tp_world: int = 1) -> list[str]:
    """The shard files of a module, (shard, tp rank) in row-major order."""
    return [shard_file(key, f, shard_world * tp_world) for f in range(shard_world * tp_world)]


class ShardedSource(ModuleSource):
    """A version-2 sharded module: each parameter's boxes (tp/boxes.py) spread over the shard files.

    Without tensor parallelism a file holds rows of every parameter; with it, file (s, t) holds the
    box rank (s, t) held. Any box of a parameter is read by intersecting it with the saved ones.
    """

    def __init__(self, files: CheckpointFiles, key: str, record: dict[str, Any]) -> None:
        super().__init__(record)
        self._files = files
        self._dp = record["shard_world"]
        self._tp = record.get("tp_world", 1)
        self._shards = module_files(key, self._dp, self._tp)

    def _saved_boxes(self, name: str) -> list[tuple[int, Box]]:
        """(file index, box) of every saved piece of parameter `name`."""
        shape, split = self.param_shapes[name], self.splits.get(self.canonical[name])
        return [
            (s * self._tp + t, held_box(shape, split=split, dp_rank=s, dp_world=self._dp, tp_rank=t, tp_world=self._tp))
            for s in range(self._dp)
            for t in range(self._tp)
            if stores(shape, split=split, dp_rank=s, tp_rank=t)
        ]

    def read_box(self, tensor: str, name: str, box: Box) -> torch.Tensor:
        """`box` of the global `tensor` of parameter `name` (or of its optimizer state), assembled from the files."""
        shape = self.param_shapes[self.canonical[name]]
        if not shape:
            return self._checked(0, tensor, ()).get_tensor(tensor)
        out = torch.empty(box.shape(shape), dtype=self.param_dtypes[self.canonical[name]])
        for f, saved in self._saved_boxes(name):
            common = box.intersect(saved, shape)
            if common is None:
                continue
            piece = self._checked(f, tensor, saved.shape(shape)).get_slice(tensor)
            rows = slice(common.rows[0] - saved.rows[0], common.rows[1] - saved.rows[0])
            into = slice(common.rows[0] - box.rows[0], common.rows[1] - box.rows[0])
            if common.cols is None:
                out[into] = piece[rows]
                continue
            saved_cols, box_cols = saved.cols or (0, shape[1]), box.cols or (0, shape[1])
            cols = slice(common.cols[0] - saved_cols[0], common.cols[1] - saved_cols[0])
            out[into, common.cols[0] - box_cols[0] : common.cols[1] - box_cols[0]] = piece[rows, cols]
        return out

    def _read_rows(self, tensor: str, name: str, start: int, numel: int) -> torch.Tensor:
        """Elements `[start, start + numel)` of the flattened `tensor` of parameter `name`, across the shards."""
        shape = self.param_shapes[self.canonical[name]]
        if not shape:
            return self.read_box(tensor, name, Box(rows=(0, 1))).reshape(-1)[start : start + numel]
        row = math.prod(shape[1:])
        first = start // row
        stop = max(first, -(-(start + numel) // row))
        rows = self.read_box(tensor, name, Box(rows=(first, stop))).reshape(-1)
        return rows[start - first * row : start - first * row + numel]

    def _checked(self, f: int, tensor: str, expected: tuple[int, ...]):
        return _checked_handle(self._files, self._shards[f], tensor, expected)

    def read_param(self, name: str, start: int, numel: int) -> torch.Tensor:
        return self._read_rows(param_tensor(self.canonical[name]), name, start, numel)

    def read_state(self, optimizer: str, key: str, name: str, start: int, numel: int) -> torch.Tensor:
        return self._read_rows(state_tensor(optimizer, key, self.canonical[name]), name, start, numel)

    def read_param_box(self, name: str, box: Box) -> torch.Tensor:
        return self.read_box(param_tensor(self.canonical[name]), name, box)

    def read_state_box(self, optimizer: str, key: str, name: str, box: Box) -> torch.Tensor:
        return self.read_box(state_tensor(optimizer, key, self.canonical[name]), name, box)

    def read_buffer(self, name: str) -> torch.Tensor:
        return self._files.tensors(self._shards[0]).get_tensor(buffer_tensor(name))


class LegacyShardedSource(ModuleSource):
    """A version-1 sharded module: one flat shard per unit, parameters back to back inside it."""

    def __init__(self, files: CheckpointFiles, key: str, record: dict[str, Any]) -> None:
        super().__init__(record)
        self._files = files
        self._units = record["units"]
        self._shards = module_files(key, record["shard_world"])
        self._where = {slot["fqn"]: (u, slot["offset"]) for u, unit in enumerate(self._units) for slot in unit["slots"]}

    def read_flat(self, tensor: str, unit: int, start: int, numel: int) -> torch.Tensor:
        """Elements `[start, start + numel)` of unit `unit`'s padded flat `tensor`, across the old shards."""
        per = self._units[unit]["shard_numel"]
        if numel == 0:
            return self._handle(0, tensor, per).get_slice(tensor)[0:0]
        parts, position, end = [], start, start + numel
        while position < end:
            shard = position // per
            low = shard * per
            high = min(end, low + per)
            parts.append(self._handle(shard, tensor, per).get_slice(tensor)[position - low : high - low])
            position = high
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _handle(self, shard: int, tensor: str, per: int):
        return _checked_handle(self._files, self._shards[shard], tensor, (per,))

    def read_param(self, name: str, start: int, numel: int) -> torch.Tensor:
        unit, offset = self._where[self.canonical[name]]
        return self.read_flat(legacy_param_tensor(unit), unit, offset + start, numel)

    def read_state(self, optimizer: str, key: str, name: str, start: int, numel: int) -> torch.Tensor:
        unit, offset = self._where[self.canonical[name]]
        return self.read_flat(legacy_state_tensor(optimizer, key, unit), unit, offset + start, numel)

    def read_buffer(self, name: str) -> torch.Tensor:
        return self._files.tensors(self._shards[0]).get_tensor(buffer_tensor(name))


def sharded_source(files: CheckpointFiles, key: str, record: dict[str, Any], *, version: int) -> ModuleSource:
    return (ShardedSource if version >= 2 else LegacyShardedSource)(files, key, record)


def _checked_handle(files: CheckpointFiles, file: str, tensor: str, expected: tuple[int, ...]):
    """The open shard `file`, once its `tensor` is checked to have the shape the metadata implies."""
    handle = files.tensors(file)
    found = tuple(handle.get_slice(tensor).get_shape()) if tensor in handle.keys() else None
    if found != expected:
        raise ValueError(
            f"{files.root / file}: tensor {tensor!r} has shape {found}, but the metadata implies {expected}; "
            "the checkpoint was edited or damaged: load an earlier one"
        )
    return handle
