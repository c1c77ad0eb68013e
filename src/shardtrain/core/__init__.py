"""The sharding engine: units, their flat parameters, communication and the schedule.

The face the rest of shardtrain may use (`__all__`); everything else in `core` is the engine's own:
`shard_module` / `runtime_of` (what `st.shard` and offload/ call), `held_params` (what `ops/`,
`checkpoint/` and `pretrained/` read and write instead of walking units and layouts), the pure
bookkeeping the planner reuses without a process group (`partition`, `layout_of_unit`), and the few
pieces the packages working on whole units, optimizers or tensor parallelism need.
"""

from .collectives import all_gather_tensor
from .gathered import GatheredUnit
from .held import HeldParam, held_params, tensor_parallel_of, tp_coordinates
from .materialize import DefaultInit
from .param_layout import ParamShard, layout_of_unit
from .partition import clean_name, matching_paths, partition, repeated_blocks
from .process_groups import require_process_group, resolve_device
from .rebind_optimizers import rebind, rebind_replaced
from .runtime import Runtime
from .shard_module import RUNTIME_ATTR, runtime_of, shard_module
from .sharded_param import local_of
from .unit import ShardUnit

__all__ = [
    "RUNTIME_ATTR",
    "DefaultInit",
    "GatheredUnit",
    "HeldParam",
    "ParamShard",
    "Runtime",
    "ShardUnit",
    "all_gather_tensor",
    "clean_name",
    "held_params",
    "layout_of_unit",
    "local_of",
    "matching_paths",
    "partition",
    "rebind",
    "rebind_replaced",
    "repeated_blocks",
    "require_process_group",
    "resolve_device",
    "runtime_of",
    "shard_module",
    "tensor_parallel_of",
    "tp_coordinates",
]
