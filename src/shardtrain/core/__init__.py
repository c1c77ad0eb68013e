"""The sharding engine: units, their flat parameters, communication and the schedule.

The face the rest of shardtrain may use (`__all__`); everything else in `core` is the engine's own:

- `shard_module(model, options)`: shard in place from a resolved `ShardOptions` (the public `st.shard`
  in sharding.py reads the user's spellings first, and offload/ wraps it); `runtime_of(model)`: its runtime.
- `held_params(model)`: what this rank holds, one read-only `HeldParam` per original parameter (name,
  global shape, this rank's rows, owner unit, the local tensor): what `ops/`, `checkpoint/` and
  `pretrained/` read and write instead of walking units and layouts.
- the pure bookkeeping the planner reuses without a process group: `partition` (which modules become
  units), `layout_of_unit` / `ParamShard` (how each parameter is cut), `clean_name`.
- `rebind` (an optimizer built before sharding), `local_of` (a parameter's local rows),
  `require_process_group` / `resolve_device`, `all_gather_tensor`.
- for the packages that work on whole units: `ShardUnit` (gathering a unit's parameters, `ops/`,
  `checkpoint/`), `GatheredUnit` (the units `ops/compile.py` compiles), `tensor_parallel_of` /
  `tp_coordinates` (the tensor parallelism a runtime runs under, this rank's place in it).
- for the Engine's tensor-parallel setup: `rebind_replaced` (parameters replaced before sharding, for `rebind`);
  `DefaultInit` (what `st.shard` initialises a meta module with; LoRA falls back to it).
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
