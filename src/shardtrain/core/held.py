"""What this rank holds of a sharded model, one read-only record per original parameter.

`ops/`, `checkpoint/` and `pretrained/` read and write a rank's rows through these records instead
of walking the runtime's units and layouts, so a change inside `core` (a field of `ParamShard`, how
a unit stores its buffers) stays inside `core`. The tensor parallelism a runtime or unit runs under
(`tensor_parallel_of`, `tp_coordinates`, each parameter's global shape, split and held box) is read
here too, so tp/tensor_parallel.py, which the units build on, knows no runtime or unit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..tp.boxes import Box, held_box
from ..tp.tensor_parallel import TensorParallel
from .param_layout import ParamShard
from .runtime import Runtime
from .shard_module import runtime_of
from .unit import ShardUnit


@dataclass(frozen=True, kw_only=True)
class HeldParam:
    """One original parameter as this rank holds it.

    `rows` are the real (not padding) rows `[start, stop)` of the original this rank holds (every
    rank holds a 0-dim parameter, or any parameter under no_shard, whole); `unit` owns it, at
    position `index`; `layout` is how it is cut (global shape, dtypes, `requires_grad`).
    """

    name: str
    aliases: tuple[str, ...]
    rows: tuple[int, int]
    unit: ShardUnit
    index: int
    layout: ParamShard

    @property
    def names(self) -> tuple[str, ...]:
        """Every name of the parameter: the canonical one, then those it is tied under."""
        return (self.name, *self.aliases)

    @property
    def shape(self) -> tuple[int, ...]:
        """The original (global) shape: under tensor parallelism the whole tensor's, not the TP-local
        one `layout` cuts over the data-parallel ranks."""
        return global_shape(self.unit, self.layout)

    @property
    def split(self) -> str | None:
        """How tensor parallelism splits the parameter ("rows", "cols"); None: not split, or no TP."""
        return split_in(self.unit, self.layout)

    @property
    def box(self) -> Box:
        """The block of the global tensor this rank holds (`local` has its shape; without tensor
        parallelism, `rows` of the original)."""
        return held_box_of(self.unit, self.index)

    @property
    def requires_grad(self) -> bool:
        return self.layout.requires_grad

    @property
    def param(self) -> nn.Parameter:
        """The parameter the optimizer sees (a DTensor of this rank's rows under sharding)."""
        return self.unit.params[self.index]

    def wrap(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` (laid out like `local`) as the kind of tensor `param` is: the optimizer's state
        must be one (a DTensor of the same placement), or its step would mix DTensors and plain tensors."""
        return self.unit.factory.wrap(rows, self.layout)

    @property
    def local(self) -> torch.Tensor:
        """This rank's rows, as a view of the unit's shard (writes go into the shard)."""
        return self.unit.held(self.index)


def held_params(model: nn.Module | Runtime) -> Iterator[HeldParam]:
    """This rank's record of every original parameter of the sharded `model`, in unit order."""
    runtime = model if isinstance(model, Runtime) else runtime_of(model)
    for unit in runtime.units:
        for index, shard in enumerate(unit.layout.params):
            yield HeldParam(
                name=shard.fqn,
                aliases=shard.aliases,
                rows=shard.held_rows(unit.comm.shard_rank if shard.world > 1 else 0) if shard.shape else (0, 1),
                unit=unit,
                index=index,
                layout=shard,
            )


def tensor_parallel_of(runtime: Runtime) -> TensorParallel | None:
    """The tensor parallelism a sharded model's runtime runs under (None: none)."""
    return runtime.units[0].factory.tp if runtime.units else None


def global_shape(unit: ShardUnit, shard: ParamShard) -> tuple[int, ...]:
    """The shape of the parameter `shard` describes as the unsharded model has it (not TP-local)."""
    tp = unit.factory.tp
    return tp.global_shape(shard) if tp is not None else shard.shape


def split_in(unit: ShardUnit, shard: ParamShard) -> str | None:
    """How tensor parallelism splits the parameter ("rows", "cols"; None: not split, or no TP)."""
    tp = unit.factory.tp
    return tp.split(shard) if tp is not None else None


def tp_coordinates(runtime: Runtime) -> tuple[int, int]:
    """(tp rank, tp size) of this rank; (0, 1) without tensor parallelism."""
    return _coordinates(tensor_parallel_of(runtime))


def _coordinates(tp: TensorParallel | None) -> tuple[int, int]:
    return (tp.tp_rank, tp.tp_size) if tp is not None else (0, 1)


def held_box_of(unit: ShardUnit, index: int) -> Box:
    """The box of parameter `index`'s global tensor this rank holds (`unit.held(index)` has its shape)."""
    shard = unit.layout.params[index]
    tp_rank, tp_world = _coordinates(unit.factory.tp)  # the model's (one factory per model)
    cut = shard.world > 1
    return held_box(
        global_shape(unit, shard),
        split=split_in(unit, shard),
        dp_rank=unit.comm.shard_rank if cut else 0,
        dp_world=shard.world,
        tp_rank=tp_rank,
        tp_world=tp_world,
    )
