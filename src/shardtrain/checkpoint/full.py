"""Full format: whole tensors under their original names, streamed to disk unit by unit.

For each sharded module, `<key>.safetensors` holds the unsharded model state dict: every parameter
under its name and under each alias of a tied weight (so that strict `load_state_dict` of the plain
model works; safetensors cannot alias two names to one buffer), then the buffers. Rank 0 writes it
while all ranks gather one unit at a time, so rank 0's host memory never holds more than one
unit. Each sharded optimizer goes the same way into `<key>.safetensors`, as `state.<fqn>.<k>`
tensors of the parameter's full shape; its scalars and param groups are in metadata.json.

Note: `ops.state_dict.full_state_dict` would hold the whole model on rank 0 before anything is
written; here each gathered unit (`gather_params`) is written and freed before the next is gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..core.shard import runtime_of
from ..ops.state_dict import gather_params
from .entries import Entries
from .format import full_file, full_state_tensor, saves
from .local import persistent_buffers
from .optim_state import OptimizerSnapshot
from .source import ModuleSource
from .tensorfile import CheckpointFiles, FileRecord, SafetensorsWriter, TensorSpec, read_flat


class _GuardedWriter:
    """Rank 0's writer inside a loop of collectives.

    An I/O error must not make rank 0 leave the loop (its peers would wait in the next all-gather
    forever), so the first error stops the writing and is raised after the loop, from `close`.
    """

    def __init__(self, path: Path, specs: list[TensorSpec]) -> None:
        self._error: Exception | None = None
        self._writer = self._guard(lambda: SafetensorsWriter(path, specs))

    def _guard(self, fn: Callable[[], Any]) -> Any:
        if self._error is None:
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - raised from close()
                self._error = exc
        return None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self._guard(lambda: self._writer.write(name, tensor))

    def close(self) -> FileRecord:
        record = self._guard(self._writer.close)
        if self._error is not None:
            raise self._error
        return record


def write_full(
    entries: Entries, snapshots: dict[str, OptimizerSnapshot], staging: Path, *, rank: int, params: str = "all"
) -> dict[str, FileRecord]:
    """All ranks gather; rank 0 writes each module's and optimizer's file. Returns rank 0's records.
    `params`: "all", or "trainable" for only the parameters that require gradients."""
    records = {}
    for key, module in entries.modules.items():
        units = runtime_of(module).units
        buffers = persistent_buffers(module)
        specs = [
            TensorSpec(name=name, dtype=unit.held(i).dtype, shape=s.shape)
            for unit in units
            for i, s in enumerate(unit.layout.params)
            if saves(s.requires_grad, params)
            for name in (s.fqn, *s.aliases)
        ]
        specs += [TensorSpec(name=n, dtype=b.dtype, shape=tuple(b.shape)) for n, b in buffers.items()]
        writer = _GuardedWriter(staging / full_file(key), specs) if rank == 0 else None
        for unit in units:
            if not any(saves(s.requires_grad, params) for s in unit.layout.params):
                continue
            whole = gather_params(unit)
            if writer is not None:
                for s, tensor in zip(unit.layout.params, whole):
                    for name in (s.fqn, *s.aliases) if saves(s.requires_grad, params) else ():
                        writer.write(name, tensor)
            del whole
        if writer is not None:
            for n, b in buffers.items():
                writer.write(n, b)
            records[full_file(key)] = writer.close()
    for key, snap in snapshots.items():
        units = runtime_of(entries.modules[snap.module]).units
        specs = [
            TensorSpec(name=full_state_tensor(s.fqn, k), dtype=snap.elementwise[k], shape=s.shape)
            for unit in units
            for k in snap.elementwise
            for s in unit.layout.params
            if snap.has(s.fqn, k)
        ]
        writer = _GuardedWriter(staging / full_file(key), specs) if rank == 0 else None
        for unit in units:
            for k in snap.elementwise:
                have = [snap.has(s.fqn, k) for s in unit.layout.params]
                if not any(have):
                    continue
                local = [
                    snap.piece(s.fqn, k) if h else unit.held(i).new_zeros(unit.held(i).shape, dtype=snap.elementwise[k])
                    for i, (s, h) in enumerate(zip(unit.layout.params, have))
                ]
                whole = gather_params(unit, local)
                if writer is not None:
                    for s, h, tensor in zip(unit.layout.params, have, whole):
                        if h:
                            writer.write(full_state_tensor(s.fqn, k), tensor)
                del whole
        if writer is not None:
            records[full_file(key)] = writer.close()
    return records


class FullSource(ModuleSource):
    def __init__(self, files: CheckpointFiles, key: str, record: dict[str, Any]) -> None:
        super().__init__(record)
        self._files = files
        self._file = full_file(key)

    def read_param(self, name: str, start: int, numel: int) -> torch.Tensor:
        return read_flat(self._files.tensors(self._file), name, start, numel)

    def read_state(self, optimizer: str, key: str, name: str, start: int, numel: int) -> torch.Tensor:
        return read_flat(self._files.tensors(full_file(optimizer)), full_state_tensor(name, key), start, numel)

    def read_buffer(self, name: str) -> torch.Tensor:
        return self._files.tensors(self._file).get_tensor(name)
