"""What the automatic plan chose (`AutoChoice`): the configuration, its predicted memory and step time,
the reasons, the runners-up for timed trials, and the arguments that apply it to `st.shard`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from ...options import ShardOptions, offload_setting, resolve_options
from ...strategy import Strategy
from .candidates import Candidate, offload_label
from .checkpointing import recompute_policy
from .estimate import MemoryEstimate
from .report import checkpointing_label
from .sizes import format_gib
from .speed import StepTime


@dataclass(frozen=True, kw_only=True)
class AutoChoice:
    """The chosen configuration, what it is predicted to need and cost, and why it was chosen."""

    strategy: Strategy
    recompute_every: int  # 0: none, 1: every block, k: blocks 0, k, 2k, ... (as estimate_memory counts)
    checkpointed_blocks: int
    cpu_offload: float  # the share of the parameters offloaded to the host (whole units); 0.0: none
    disk_dir: str | None  # the disk tier's directory for the offloaded optimizer state; None: host memory
    micro_batch: int  # sequences per rank per micro-step
    grad_accum: int
    seq_len: int
    world_size: int
    device_memory: int
    usable_memory: int  # device_memory less the safety margin
    predicted_bytes: int  # device memory needed: peak allocated + reserve + no_sync accumulation
    step_time: StepTime
    reasons: tuple[str, ...]
    estimate: MemoryEstimate = field(repr=False)
    runners_up: tuple[Candidate, ...] = field(default=(), repr=False)  # next fastest that fit, in order

    @classmethod
    def of(
        cls,
        best: Candidate,
        *,
        runners_up: tuple[Candidate, ...],
        seq_len: int,
        world_size: int,
        device_memory: int,
        usable_memory: int,
        reasons: tuple[str, ...],
    ) -> AutoChoice:
        """The choice of the `best` candidate, the `runners_up` kept for timed trials."""
        return cls(
            strategy=best.strategy,
            recompute_every=best.recompute_every,
            checkpointed_blocks=best.checkpointed_blocks,
            cpu_offload=best.cpu_offload,
            disk_dir=best.disk_dir,
            micro_batch=best.micro_batch,
            grad_accum=best.grad_accum,
            seq_len=seq_len,
            world_size=world_size,
            device_memory=device_memory,
            usable_memory=usable_memory,
            predicted_bytes=best.needed,
            step_time=best.time,
            reasons=reasons,
            estimate=best.estimate,
            runners_up=runners_up,
        )

    def alternatives(self) -> list[AutoChoice]:
        """This choice, then each runner-up as a choice of its own (what timed trials compare)."""
        return [self] + [
            replace(
                self,
                strategy=c.strategy,
                recompute_every=c.recompute_every,
                checkpointed_blocks=c.checkpointed_blocks,
                cpu_offload=c.cpu_offload,
                disk_dir=c.disk_dir,
                micro_batch=c.micro_batch,
                grad_accum=c.grad_accum,
                predicted_bytes=c.needed,
                step_time=c.time,
                estimate=c.estimate,
                runners_up=(),
                reasons=(f"runner-up {rank} of the prediction: step time {c.time.relative:.3f} x the ideal",),
            )
            for rank, c in enumerate(self.runners_up, start=1)
        ]

    @property
    def relative_step_time(self) -> float:
        """Predicted step time over the ideal (the step's FLOPs at full efficiency, nothing else)."""
        return self.step_time.relative

    @property
    def activation_checkpointing(self) -> bool | int:
        """As estimate_memory and the train config take it: False, True (every block) or k."""
        return {0: False, 1: True}.get(self.recompute_every, self.recompute_every)

    def shard_kwargs(self, model: nn.Module, *, wrap: Any) -> dict[str, Any]:
        """strategy, activation_checkpointing and cpu_offload for `st.shard(model, wrap=wrap, ...)`."""
        return {
            "strategy": self.strategy,
            "cpu_offload": offload_setting(self.cpu_offload, disk_dir=self.disk_dir),
            "activation_checkpointing": recompute_policy(model, wrap=wrap, every=self.recompute_every),
        }

    def applied_to(self, options: ShardOptions, model: nn.Module) -> ShardOptions:
        """`options` with this choice's strategy, activation checkpointing and offload."""
        chosen = resolve_options(wrap=options.wrap, **self.shard_kwargs(model, wrap=options.wrap))
        return replace(
            options,
            strategy=chosen.strategy,
            activation_checkpointing=chosen.activation_checkpointing,
            offload=chosen.offload,
        )

    def __str__(self) -> str:
        offload = offload_label(self.cpu_offload, disk=self.disk_dir is not None)
        checkpointing = checkpointing_label(self.recompute_every)
        head = (
            f"automatic plan: {self.estimate.inputs.label}, activation checkpointing {checkpointing}{offload}, "
            f"micro-batch {self.micro_batch} x {self.grad_accum} accumulation step{'s' * (self.grad_accum > 1)}, "
            f"seq {self.seq_len}, "
            f"{self.world_size} devices: {format_gib(self.predicted_bytes)} GiB of "
            f"{format_gib(self.device_memory)} GiB, step time {self.relative_step_time:.3f} x the ideal"
        )
        return "\n".join([head, *(f"- {r}" for r in self.reasons)])
