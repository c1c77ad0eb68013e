"""BenchEngine names accepted by `shardtrain bench --engines`, and what each one builds.

`shardtrain` is full_shard; `shardtrain-<strategy>` takes any strategy name of `st.shard`
(`shardtrain-zero2` = shard_grad_op, `shardtrain-no_shard`, ...); `shardtrain-auto` lets the planner
choose strategy, checkpointing and offload for the run's micro-batch. `ideal` is not an engine but the
reference step of `ideal.py`, run in one process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..strategy import parse_strategy
from .engines import Prepared, build_ddp, build_fsdp1, build_fsdp2, build_shardtrain, build_shardtrain_auto
from .ideal import build_ideal
from .spec import RunSpec

BASELINE = "fsdp2"  # the engine every row is compared with
DEFAULT_ENGINES = ("shardtrain", "fsdp2", "fsdp1", "ddp")
IDEAL = "ideal"


@dataclass(frozen=True, kw_only=True)
class BenchEngine:
    name: str
    label: str
    build: Callable[[RunSpec, torch.device], Prepared]
    single_process: bool = False


_FIXED = {
    "fsdp2": BenchEngine(
        name="fsdp2", label="torch FSDP2", build=functools.partial(build_fsdp2, reshard_after_forward=True)
    ),
    "fsdp2-noreshard": BenchEngine(
        name="fsdp2-noreshard",
        label="torch FSDP2 (reshard_after_forward=False)",
        build=functools.partial(build_fsdp2, reshard_after_forward=False),
    ),
    "fsdp2-split": BenchEngine(
        name="fsdp2-split",
        label="torch FSDP2 (embedding, head apart)",
        build=functools.partial(build_fsdp2, reshard_after_forward=True, split_root=True),
    ),
    "fsdp1": BenchEngine(name="fsdp1", label="torch FSDP1 (FULL_SHARD)", build=build_fsdp1),
    "ddp": BenchEngine(name="ddp", label="DDP", build=build_ddp),
    "shardtrain-auto": BenchEngine(name="shardtrain-auto", label="shardtrain auto", build=build_shardtrain_auto),
    IDEAL: BenchEngine(name=IDEAL, label="ideal step (1 GPU, no collectives)", build=build_ideal, single_process=True),
}


def resolve_engine(name: str) -> BenchEngine:
    """The engine called `name`; a clear error listing the valid names otherwise."""
    key = name.strip().lower()
    if key in _FIXED:
        return _FIXED[key]
    if key == "shardtrain" or key.startswith("shardtrain-"):
        try:
            strategy = parse_strategy(key.partition("-")[2] or "full_shard")
        except ValueError as exc:
            raise ValueError(f"engine {name!r}: {exc}") from None
        return BenchEngine(
            name=key,
            label=f"shardtrain ({strategy.value})",
            build=functools.partial(build_shardtrain, strategy=strategy.value),
        )
    raise ValueError(
        f"unknown engine {name!r}; use shardtrain, shardtrain-<strategy> (e.g. shardtrain-zero2), "
        f"or one of {sorted(_FIXED)}"
    )
