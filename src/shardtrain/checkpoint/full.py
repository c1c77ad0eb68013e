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

from pathlib import Path
from typing import Any

import torch

from ..core.held import held_params
from ..core.param_layout import ParamShard
from ..core.shard_module import runtime_of
from ..core.unit import ShardUnit
from ..ops.state_dict import gather_params
from .collective import FirstError
from .entries import Entries
from .format import full_file, full_state_tensor, saves
from .optim_state import OptimizerSnapshot
from .source import ModuleSource
from .tensorfile import CheckpointFiles, FileRecord, SafetensorsWriter, TensorSpec, read_flat
from .this_rank import persistent_buffers


def write_full_modules(entries: Entries, staging: Path, *, rank: int, params: str = "all") -> dict[str, FileRecord]:
    """All ranks gather; rank 0 writes each module's file. Returns rank 0's records. `params`: "all",
    or "trainable" for only the parameters that require gradients. A local error is raised only
    after the last gather (docs/design.md, Note [Errors inside a loop of collectives])."""
    records, failed = {}, FirstError()
    for key, module in entries.modules.items():
        units = runtime_of(module).units
        buffers = persistent_buffers(module)
        specs = [
            TensorSpec(name=name, dtype=h.local.dtype, shape=h.shape)
            for h in held_params(module)
            if saves(h.requires_grad, params)
            for name in h.names
        ]
        specs += [TensorSpec(name=n, dtype=b.dtype, shape=tuple(b.shape)) for n, b in buffers.items()]
        writer = failed.run(lambda: SafetensorsWriter(staging / full_file(key), specs)) if rank == 0 else None
        for unit in units:
            if not any(saves(s.requires_grad, params) for s in unit.layout.params):
                continue
            whole = gather_params(unit)
            if writer is not None:
                for s, tensor in zip(unit.layout.params, whole):
                    for name in (s.fqn, *s.aliases) if saves(s.requires_grad, params) else ():
                        failed.run(lambda: writer.write(name, tensor))
            del whole
        if writer is not None:
            for n, b in buffers.items():
                failed.run(lambda: writer.write(n, b))
            records[full_file(key)] = failed.run(writer.close)
    failed.check()
    return records


def write_full_optimizers(
    entries: Entries, snapshots: dict[str, OptimizerSnapshot], staging: Path, *, rank: int
) -> dict[str, FileRecord]:
    """All ranks gather each sharded optimizer's elementwise state; rank 0 writes its file. Returns
    rank 0's records; a local error is raised only after the last gather, as above."""
    records, failed = {}, FirstError()
    for key, snap in snapshots.items():
        runtime = runtime_of(entries.modules[snap.module])
        units, shapes = runtime.units, {h.name: h.shape for h in held_params(runtime)}
        specs = [
            TensorSpec(name=full_state_tensor(s.fqn, k), dtype=snap.elementwise[k], shape=shapes[s.fqn])
            for unit in units
            for k in snap.elementwise
            for s in unit.layout.params
            if snap.has(s.fqn, k)
        ]
        writer = failed.run(lambda: SafetensorsWriter(staging / full_file(key), specs)) if rank == 0 else None
        for unit in units:
            for k in snap.elementwise:
                have = [snap.has(s.fqn, k) for s in unit.layout.params]
                if not any(have):
                    continue
                dtype = snap.elementwise[k]
                local = failed.run(
                    lambda: [
                        _state_rows(snap, s, k, like=unit.held(i), dtype=dtype) if h else _zeros(unit, i, dtype)
                        for i, (s, h) in enumerate(zip(unit.layout.params, have))
                    ],
                    fallback=lambda: [_zeros(unit, i, dtype) for i in range(len(have))],  # the gather's shapes
                )
                whole = gather_params(unit, local)
                if writer is not None:
                    for s, h, tensor in zip(unit.layout.params, have, whole):
                        if h:
                            failed.run(lambda: writer.write(full_state_tensor(s.fqn, k), tensor))
                del whole
        if writer is not None:
            records[full_file(key)] = failed.run(writer.close)
    failed.check()
    return records


def _zeros(unit: ShardUnit, index: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros in place of this rank's rows of parameter `index` of `unit`."""
    return unit.held(index).new_zeros(unit.held(index).shape, dtype=dtype)


def _state_rows(
    snap: OptimizerSnapshot, shard: ParamShard, key: str, *, like: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """This rank's rows of state `key` of `shard`, checked to be shaped like the parameter's rows (`like`)
    before they enter a gather."""
    piece = snap.piece(shard.fqn, key)
    assert piece is not None  # the caller asked snap.has first
    if piece.shape != like.shape or piece.dtype != dtype:
        raise RuntimeError(
            f"optimizer state {key!r} of {shard.fqn}: this rank holds {tuple(piece.shape)} {piece.dtype}, "
            f"where its rows of the parameter are {tuple(like.shape)} {dtype}"
        )
    return piece


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
