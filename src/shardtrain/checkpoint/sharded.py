"""Sharded format: each shard written once by the rank that holds it, read back at any world size.

Per sharded module and shard rank s (of S), one safetensors file holds, for every unit u, the flat
shard `param.u` (elements `[s * shard_numel, (s + 1) * shard_numel)` of the unit's padded flat
parameter) and, per optimizer over the module and elementwise state key k, `optim.<opt>.<k>.u` laid
out the same way; shard 0's file also holds the buffers. No communication: every rank writes what
it holds, and a replica (hybrid_shard, no_shard) that is not the first writes nothing.

Reading a range of one flattened parameter maps it into the saved unit's flat space and takes the
overlapping slices of the old shards' files (safetensors reads slices without loading the rest).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..core.shard import runtime_of
from .entries import Entries
from .format import buffer_tensor, param_tensor, shard_file, state_tensor
from .local import persistent_buffers, writes_shards
from .optim_state import OptimizerSnapshot
from .source import ModuleSource
from .tensorfile import CheckpointFiles, FileRecord, SafetensorsWriter, TensorSpec


def write_shards(entries: Entries, snapshots: dict[str, OptimizerSnapshot], staging: Path) -> dict[str, FileRecord]:
    """Write this rank's shard files (if it is in the first replica); return their records."""
    records = {}
    for key, module in entries.modules.items():
        runtime = runtime_of(module)
        if not writes_shards(runtime):
            continue
        shard = runtime.groups.shard_rank
        states = [(name, k, snap) for name, snap in snapshots.items() if snap.module == key for k in snap.elementwise]
        buffers = persistent_buffers(module) if shard == 0 else {}
        specs = []
        for u, unit in enumerate(runtime.units):
            specs.append(TensorSpec(name=param_tensor(u), dtype=unit.shard.dtype, shape=(unit.shard.numel(),)))
            specs += [TensorSpec(name=state_tensor(name, k, u), dtype=snap.elementwise[k], shape=(unit.shard.numel(),))
                      for name, k, snap in states]
        specs += [TensorSpec(name=buffer_tensor(n), dtype=b.dtype, shape=tuple(b.shape)) for n, b in buffers.items()]
        file = shard_file(key, shard, runtime.groups.shard_world)
        writer = SafetensorsWriter(staging / file, specs)
        for u, unit in enumerate(runtime.units):
            writer.write(param_tensor(u), unit.shard)
            for name, k, snap in states:
                writer.write(state_tensor(name, k, u), snap.flat(unit, k))
        for n, b in buffers.items():
            writer.write(buffer_tensor(n), b)
        records[file] = writer.close()
    return records


def module_files(key: str, shard_world: int) -> list[str]:
    return [shard_file(key, s, shard_world) for s in range(shard_world)]


class ShardedSource(ModuleSource):
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
            return self._files.tensors(self._shards[0]).get_slice(tensor)[0:0]
        parts, position, end = [], start, start + numel
        while position < end:
            shard = position // per
            low = shard * per
            high = min(end, low + per)
            parts.append(self._files.tensors(self._shards[shard]).get_slice(tensor)[position - low:high - low])
            position = high
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read_param(self, name: str, start: int, numel: int) -> torch.Tensor:
        unit, offset = self._where[name]
        return self.read_flat(param_tensor(unit), unit, offset + start, numel)

    def read_state(self, optimizer: str, key: str, name: str, start: int, numel: int) -> torch.Tensor:
        unit, offset = self._where[name]
        return self.read_flat(state_tensor(optimizer, key, unit), unit, offset + start, numel)

    def read_buffer(self, name: str) -> torch.Tensor:
        return self._files.tensors(self._shards[0]).get_tensor(buffer_tensor(name))
