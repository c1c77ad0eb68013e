"""What `Engine(tp=N)` adds to the engine: its checks before any process starts, and at setup the
("dp", "tp") mesh and the model's tensor-parallel plan handed to `st.shard`.

The engine builds the mesh itself (data-parallel ranks = world // tp, each tp group's ranks next to
each other, as `init_device_mesh` places them), so it refuses what needs another mesh (the hybrid
strategies), and, through tp/refusals.py, the automatic plan and offload: each as one line naming the
setting and the fix.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..options import ShardOptions
from ..policy import AutoPolicy, CPUOffload
from .mesh import FLAT_NAMES
from .plans import plan_for
from .refusals import refuse_auto, refuse_offload


def check_tensor_parallel(
    *, tp: int, options: ShardOptions, auto: AutoPolicy | None, cpu_offload: CPUOffload | bool | float
) -> None:
    """What tp > 1 refuses, before any process starts (`auto`: the engine's st.AutoPolicy, or None)."""
    refuse_auto(auto=auto is not None, tp=tp > 1, spelled=f"Engine(tp={tp}) with strategy=st.AutoPolicy")
    if options.strategy.is_hybrid:
        raise ValueError(
            f"Engine(tp={tp}) with strategy={options.strategy.value!r}: the engine builds a ('dp', 'tp') "
            "mesh; use 'full_shard' or 'shard_grad_op', or call st.shard(model, mesh=<('replicate', "
            "'shard', 'tp') DeviceMesh>) yourself"
        )
    refuse_offload(options.offload, spelled=f"Engine(tp={tp})", given=cpu_offload)


def dp_tp_mesh(device: torch.device, *, data_parallel: int, tp: int) -> DeviceMesh:
    """The ("dp", "tp") DeviceMesh of `data_parallel` x `tp` ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (data_parallel, tp), mesh_dim_names=FLAT_NAMES)


def with_tensor_parallel(model: nn.Module, options: ShardOptions, *, mesh: DeviceMesh) -> ShardOptions:
    """`options` on `mesh` with the model's plan (a model built on the meta device stays there: st.shard
    materialises it unit by unit)."""
    return dataclasses.replace(options, mesh=mesh, tp_plan=options.tp_plan or plan_for(model))
