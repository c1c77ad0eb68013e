"""Predicted step time of a training configuration: the speed half of the automatic plan.

A step costs compute (with recomputation, at a mild per-micro-batch efficiency), the all-gathers
prefetching leaves exposed, a fixed per-step overhead and, with CPU offload, what `offload_time`
adds; all in "token-times" (one token's FLOPs at ACHIEVED_FLOPS), so only ratios between
configurations of one model, world and batch mean anything. The terms and where each constant came
from: docs/design.md, Note [Step-time model]; the model against measured steps: BENCHMARKS.md,
'Step-time model of the automatic plan'.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from ...strategy import Strategy
from .model_spec import LlamaShape, ModelSpec
from .offload_time import OffloadWork, offload_step_time

REFERENCE_TOKENS = 4096
EFFICIENCY_TOKENS = 256
GATHER_EXPOSED_FRACTION = 0.03
GATHER_EXPOSED_TOKENS = GATHER_EXPOSED_FRACTION * REFERENCE_TOKENS
STEP_OVERHEAD_TOKENS = 1950  # fitted with ACHIEVED_FLOPS to torch FSDP2's 8B steps (module docstring)
ACHIEVED_FLOPS = 0.79 * 790e12  # one token-time is a token's training FLOPs at this rate (fitted)
FLOAT8_SPEEDUP = 1.10  # compute and recompute with float8 Linears: BENCHMARKS.md, 'float8 against bf16 (1 × H100)'


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """One step's predicted time in token-times (see the module docstring), itemised."""

    tokens: int  # per rank and step
    compute: float
    recompute: float
    gathers: float
    overhead: float
    offload: float = 0.0  # the host step and the copies beyond the resident step
    disk: float = 0.0  # the disk tier beyond the host step and the copies
    disk_s: float = 0.0  # the disk tier's reads and writes per step, in seconds (0: no disk tier)
    token_s: float  # seconds per token-time

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.gathers + self.overhead + self.offload + self.disk

    @property
    def seconds(self) -> float:
        """The predicted step in seconds (at ACHIEVED_FLOPS)."""
        return self.total * self.token_s

    @property
    def relative(self) -> float:
        """Total over the ideal (the tokens' FLOPs at full efficiency in bf16, nothing else): 1.0 or more,
        except with float8 Linears, whose matmuls beat the bf16 rate."""
        return self.total / self.tokens

    def describe(self) -> str:
        parts = [
            ("compute", self.compute),
            ("recompute", self.recompute),
            ("exposed all-gathers", self.gathers),
            ("step overhead", self.overhead),
            ("CPU offload", self.offload),
            ("disk tier", self.disk),
        ]
        items = ", ".join(f"{name} {value / self.tokens:.3f}" for name, value in parts if value)
        return f"{self.relative:.3f} x the ideal ({items}), {self.seconds:.2f} s"


def flops_per_token(shape: LlamaShape, *, seq_len: int, trainable: int | None = None) -> float:
    """Training FLOPs per token: 6 * (params - embedding) + 6 * layers * dim * seq. With `trainable`
    parameters of a frozen base (a fine-tune), backward computes no weight gradients for the others:
    4 * (params - embedding) + 2 * trainable + 6 * layers * dim * seq."""
    matmul = shape.num_params - shape.vocab_size * shape.dim
    weights = matmul if trainable is None else min(trainable, matmul)
    return 4 * matmul + 2 * weights + 6 * shape.n_layers * shape.dim * seq_len


def recompute_fraction(
    shape: LlamaShape, *, seq_len: int, checkpointed_blocks: int, trainable: int | None = None
) -> float:
    """Extra FLOPs of recomputing `checkpointed_blocks` blocks' forward, as a fraction of F."""
    per_block = 2 * shape.block_params + 2 * shape.dim * seq_len
    return checkpointed_blocks * per_block / flops_per_token(shape, seq_len=seq_len, trainable=trainable)


def _trainable(model: ModelSpec) -> int | None:
    """The trainable parameters of a fine-tune (None: everything trains)."""
    return model.trainable_params if model.frozen_params else None


def efficiency(tokens: int) -> float:
    """Fraction of the achievable rate a micro-batch of `tokens` tokens reaches: t / (t + 256)."""
    return tokens / (tokens + EFFICIENCY_TOKENS)


def exposed_gathers(strategy: Strategy, *, shard_size: int) -> int:
    """All-gathers per micro-batch beyond shard_grad_op's: full_shard's second gather in backward."""
    return int(strategy.reshard_after_forward and shard_size > 1)


def token_seconds(model: ModelSpec, *, seq_len: int) -> float:
    """Seconds of one token-time: a token's training FLOPs at ACHIEVED_FLOPS."""
    per_token = (
        flops_per_token(model.shape, seq_len=seq_len, trainable=_trainable(model))
        if model.shape
        else 6 * model.num_params
    )
    return per_token / ACHIEVED_FLOPS


def step_time(
    *,
    model: ModelSpec,
    strategy: Strategy,
    shard_size: int,
    checkpointed_blocks: int,
    micro_batch: int,
    grad_accum: int,
    seq_len: int,
    offload: OffloadWork | None = None,
    float8: bool = False,
) -> StepTime:
    """Predicted time of one optimizer step (grad_accum micro-batches of micro_batch sequences);
    `offload`: what CPU offload moves per rank (None: nothing); `float8`: the large Linears train in
    float8, the compute and its recomputation FLOAT8_SPEEDUP times faster (the whole step's measured
    ratio, applied to those terms only)."""
    micro_tokens = micro_batch * seq_len
    tokens = micro_tokens * grad_accum
    compute = tokens / efficiency(micro_tokens) / (FLOAT8_SPEEDUP if float8 else 1.0)
    recompute = 0.0
    if checkpointed_blocks:
        if model.shape is None:
            raise ValueError(
                f"checkpointed_blocks={checkpointed_blocks} needs the model's shape to price the "
                f"recomputation; {model.name} has none (pass dim= and layers= hints)"
            )
        recompute = compute * recompute_fraction(
            model.shape, seq_len=seq_len, checkpointed_blocks=checkpointed_blocks, trainable=_trainable(model)
        )
    resident = StepTime(
        tokens=tokens,
        compute=compute,
        recompute=recompute,
        gathers=grad_accum * exposed_gathers(strategy, shard_size=shard_size) * GATHER_EXPOSED_TOKENS,
        overhead=STEP_OVERHEAD_TOKENS,
        token_s=token_seconds(model, seq_len=seq_len),
    )
    if offload is None or not offload.params:
        return resident
    phases = partial(
        offload_step_time,
        resident_step_s=resident.seconds,
        offloaded_params=offload.params,
        checkpointed=model.shape is not None and checkpointed_blocks == model.shape.n_layers,
        reshard_after_forward=offload.reshard_after_forward,
        units=offload.units,
    )
    host, with_disk = phases(), phases(disk_state_bytes=offload.disk_state_bytes)
    host_s = host.step_s(offload.host_step) - resident.seconds
    disk_s = with_disk.step_s(offload.host_step) - resident.seconds - host_s
    return replace(resident, offload=host_s / resident.token_s, disk=disk_s / resident.token_s, disk_s=with_disk.disk_s)
