"""The configurations the automatic plan weighs: each with its memory bill and predicted step time.

A candidate fixes a strategy, activation checkpointing, the share of the model CPU offload moves to
the host (with or without the disk tier) and a micro_batch x grad_accum split of each rank's batch.
Its device memory is the estimator's peak plus reserve and, with gradient accumulation, the unsharded
gradients `no_sync` keeps; its host memory adds the disk tier's buffers (docs/design.md, Note
[Choosing a plan]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...offload import DEFAULT_SLOTS
from ...policy import CPUOffload
from ...strategy import Strategy, parse_strategy
from .activations import checkpointed_blocks
from .compare import default_shard_size
from .estimate import MemoryEstimate, estimate_memory
from .moments import offloaded_units
from .offload_time import OffloadWork, host_step_of
from .speed import StepTime, step_time


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One configuration: what it is, what it needs per device, how long its step is predicted to take."""

    strategy: Strategy
    recompute_every: int  # 0: none, 1: every block, k: blocks 0, k, 2k, ...
    checkpointed_blocks: int
    cpu_offload: float  # the share of the parameters offloaded (whole units); 0.0: none
    micro_batch: int
    grad_accum: int
    estimate: MemoryEstimate
    accumulation_bytes: int  # unsharded gradients held by no_sync between micro-batches
    time: StepTime
    disk_dir: str | None = None  # the disk tier's directory for the offloaded optimizer state; None: host memory
    disk_pool_bytes: int = 0  # the disk tier's host buffers

    @property
    def host_bytes(self) -> int:
        """Host memory per process: the estimator's host bytes and the disk tier's buffer pool."""
        return self.estimate.host + self.disk_pool_bytes

    @property
    def needed(self) -> int:
        """Device memory needed: the peak allocated, the reserve, and the no_sync accumulation."""
        return self.estimate.total + self.estimate.reserve + self.accumulation_bytes

    @property
    def checkpointing(self) -> str:
        layers = self.estimate.inputs.model.shape.n_layers if self.estimate.inputs.model.shape else 0
        if self.recompute_every == 0:
            return "no activation checkpointing"
        if self.checkpointed_blocks == layers:
            return "every block checkpointed"
        return f"1 block in {self.recompute_every} checkpointed ({self.checkpointed_blocks} of {layers})"

    def describe(self) -> str:
        return (
            f"{self.estimate.inputs.label}, {self.checkpointing}{offload_label(self.cpu_offload, disk=self.disk_dir is not None)}, "
            f"micro-batch {self.micro_batch} x {self.grad_accum} accumulation step{'s' * (self.grad_accum > 1)}"
        )


def offload_label(fraction: float, *, disk: bool = False) -> str:
    """ ", CPU offload" (everything), ", CPU offload of 50%" (partial), or "" (none); with the disk tier
    ", CPU offload, optimizer state on disk"."""
    if not fraction:
        return ""
    label = ", CPU offload" if fraction == 1 else f", CPU offload of {fraction:.0%}"
    return label + ", optimizer state on disk" * disk


def accumulation_bytes(estimate: MemoryEstimate, *, grad_accum: int) -> int:
    """The unsharded gradients no_sync holds between micro-batches: every trainable parameter in the reduce dtype."""
    return estimate.inputs.model.trainable_params * estimate.inputs.reduce_bytes if grad_accum > 1 else 0


def checkpoint_options(n_layers: int) -> list[tuple[int, int]]:
    """(every, checkpointed blocks) from none to every block; for each count, the smallest `every`
    giving it (the most even spread of the checkpointed blocks)."""
    options = {0: 0}
    for every in range(n_layers, 0, -1):
        options[checkpointed_blocks(n_layers, every)] = every
    return [(every, count) for count, every in sorted(options.items())]


def batch_splits(sequences: int) -> list[tuple[int, int]]:
    """(micro_batch, grad_accum) pairs with micro_batch * grad_accum == sequences, largest micro-batch first."""
    return [(mb, sequences // mb) for mb in range(sequences, 0, -1) if sequences % mb == 0]


def evaluate(
    model: Any,
    *,
    world_size: int,
    strategies: list[Strategy],
    splits: list[tuple[int, int]],
    seq_len: int,
    cpu_offload: float,
    estimate_kwargs: dict[str, Any],
    disk_dir: str | None = None,
) -> list[Candidate]:
    """Every (strategy, checkpointing, split) candidate with the given share offloaded (0.0: none), its
    optimizer state in files under `disk_dir` when one is given."""
    probe = estimate_memory(model, world_size=world_size, seq_len=seq_len, **estimate_kwargs)
    spec = probe.inputs.model
    policy = CPUOffload(fraction=cpu_offload, disk_dir=disk_dir) if cpu_offload else None
    options = checkpoint_options(spec.shape.n_layers) if spec.shape else [(0, 0)]
    out = []
    for strategy in strategies:
        shard_size = default_shard_size(world_size) if strategy.is_hybrid else None
        for every, count in options:
            base = estimate_memory(
                model,
                world_size=world_size,
                strategy=strategy,
                shard_size=shard_size,
                activation_checkpointing=every,
                cpu_offload=policy or False,
                seq_len=seq_len,
                **estimate_kwargs,
            )
            for micro_batch, grad_accum in splits:
                estimate = base.with_micro_batch(micro_batch)
                out.append(
                    Candidate(
                        strategy=strategy,
                        recompute_every=every,
                        checkpointed_blocks=count,
                        cpu_offload=cpu_offload,
                        micro_batch=micro_batch,
                        grad_accum=grad_accum,
                        estimate=estimate,
                        accumulation_bytes=accumulation_bytes(estimate, grad_accum=grad_accum),
                        disk_dir=disk_dir if policy else None,
                        disk_pool_bytes=disk_pool_bytes(estimate) if policy and disk_dir is not None else 0,
                        time=predicted_time(estimate, grad_accum=grad_accum),
                    )
                )
    return out


def predicted_time(estimate: MemoryEstimate, *, grad_accum: int) -> StepTime:
    """The step time of `estimate`'s configuration with `grad_accum` micro-batches per step (speed.py),
    its CPU offload and disk tier included."""
    inputs = estimate.inputs
    layers = inputs.model.shape.n_layers if inputs.model.shape else 0
    return step_time(
        model=inputs.model,
        strategy=inputs.strategy,
        shard_size=inputs.shard_size,
        checkpointed_blocks=checkpointed_blocks(layers, inputs.recompute_every),
        micro_batch=inputs.micro_batch,
        grad_accum=grad_accum,
        seq_len=inputs.seq_len,
        offload=offload_work(estimate),
        float8=inputs.float8 is not None,
    )


def offload_work(estimate: MemoryEstimate) -> OffloadWork | None:
    """What `estimate`'s CPU offload moves per rank and how its host step runs (None: no offload)."""
    policy = estimate.inputs.offload
    if policy is None:
        return None
    units = offloaded_units(estimate.inputs.model, policy)
    return OffloadWork(
        params=sum(units) // estimate.inputs.shard_size,
        units=max(1, len(units)),
        host_step=host_step_of(policy),
        disk_state_bytes=estimate.disk,
        reshard_after_forward=policy.reshards_after_forward(
            strategy_reshards=estimate.inputs.strategy.reshard_after_forward
        ),
    )


def disk_pool_bytes(estimate: MemoryEstimate) -> int:
    """The disk tier's default buffer pool per process: `DEFAULT_SLOTS` x the largest unit's optimizer state."""
    spec, inputs = estimate.inputs.model, estimate.inputs
    largest = max([spec.root_params, *spec.unit_params])
    return DEFAULT_SLOTS * int(largest * inputs.optimizer_bytes / inputs.shard_size)


def parse_strategies(strategies: Any) -> list[Strategy]:
    parsed = [parse_strategy(s) for s in strategies]
    if not parsed:
        raise ValueError(f"strategies={strategies!r} is empty; name at least one, e.g. ('full_shard',)")
    return list(dict.fromkeys(parsed))
