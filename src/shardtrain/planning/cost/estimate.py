"""Per-device memory bill of one training step, by sharding strategy, without touching a GPU.

The bill is the peak over four moments of the step (`moments`), for full training, a fine-tune of a
frozen base and tensor parallelism, plus the reserve (CUDA context, NCCL, fragmentation) that `fits`
adds before comparing with the device's memory. What each term counts and how it was calibrated:
docs/design.md, Note [Memory moments]; the estimate against measured peaks: BENCHMARKS.md, 'Memory
estimator against measured peaks (2 × H200)'.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ...options import resolve_options
from ...policy import CPUOffload, MixedPrecision
from ...tp.mesh import check_tp_divides
from .finetune import fine_tune_spec
from .float8_cost import float8_linears
from .inputs import EstimateInputs, optimizer_bytes, positive_int, recompute_every_of, shard_size_of
from .model_input import resolve_model
from .moments import moments, step_states
from .preference import with_reference
from .report import format_estimate
from .sizes import GiB, parse_bytes
from .tensor_parallel import tp_collectives, tp_local_spec

OVERHEAD_BYTES = GiB // 4  # work buffers and small state the itemised terms leave out (calibrated)
CONTEXT_BYTES = 3 * GiB // 2  # CUDA context + NCCL: device memory the caching allocator never sees
FRAGMENTATION = 0.05  # fraction of the peak kept for the caching allocator's fragmentation
MAX_MICRO_BATCH = 1 << 16


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes per device at the step's peak (`peak_phase`), itemised so that the items sum to `total`.

    `host` is what CPU offload keeps in host memory, per process (times the processes of a node);
    `disk` what its disk tier keeps in files, per process.
    """

    parameters: int  # fp32 master weights (the shard, or all of them when unsharded), frozen ones as stored
    gradients: int  # fp32 gradients (sharded unless no_shard)
    optimizer_state: int
    unsharded_params: int  # param-dtype copies of gathered (or resident) units
    unsharded_grads: int  # param-dtype gradients of the units in backward
    reduce_buffers: int  # reduce-dtype buffers of the gradient collectives
    activations: int
    logits: int  # logits and cross-entropy tensors
    overhead: int
    host: int
    disk: int = 0  # the offloaded optimizer state in the disk tier's files, per process (CPUOffload(disk_dir=))
    peak_phase: str
    phase_totals: tuple[tuple[str, int], ...]
    notes: tuple[str, ...]
    inputs: EstimateInputs = field(repr=False)

    @property
    def total(self) -> int:
        """Predicted peak allocated bytes (what torch.cuda.max_memory_allocated() reports)."""
        return self.model_states + self.units_in_flight + self.activations + self.logits + self.overhead

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def units_in_flight(self) -> int:
        return self.unsharded_params + self.unsharded_grads + self.reduce_buffers

    @property
    def reserve(self) -> int:
        """Device memory needed beyond `total`: CUDA context, NCCL buffers, allocator fragmentation."""
        return CONTEXT_BYTES + int(FRAGMENTATION * self.total)

    def fits(self, device_memory: int | str) -> bool:
        """Whether total + reserve fits in `device_memory` (bytes, or a size such as '80GiB')."""
        return self.total + self.reserve <= parse_bytes(device_memory)

    def with_micro_batch(self, micro_batch: int) -> MemoryEstimate:
        return _estimate(replace(self.inputs, micro_batch=positive_int(micro_batch, "micro_batch")))

    def largest_micro_batch(self, device_memory: int | str) -> int:
        """The largest micro-batch (per device) that `fits` in `device_memory`; 0 when even 1 does not."""
        limit = parse_bytes(device_memory)
        if self.inputs.model.shape is None:
            raise ValueError(
                "the largest micro-batch needs the activation estimate, which this model lacks; "
                "pass shape hints (dim=, layers=, vocab=, ...) to estimate_memory"
            )
        if not self.with_micro_batch(1).fits(limit):
            return 0
        lo, hi = 1, 2
        while hi <= MAX_MICRO_BATCH and self.with_micro_batch(hi).fits(limit):
            lo, hi = hi, hi * 2
        hi = min(hi, MAX_MICRO_BATCH + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.with_micro_batch(mid).fits(limit) else (lo, mid)
        return lo

    def __str__(self) -> str:
        return format_estimate(self)


def estimate_memory(
    model_or_spec: Any = None,
    /,
    *,
    world_size: int,
    strategy: Any = "full_shard",
    shard_size: int | None = None,
    precision: str | MixedPrecision | None = "bf16",
    activation_checkpointing: bool | int = False,
    cpu_offload: bool | CPUOffload = False,
    micro_batch: int = 1,
    seq_len: int = 4096,
    optimizer: str | float = "adamw",
    in_flight: int = 2,
    keep_grads: bool = False,
    device_memory: int | str | None = None,
    wrap=None,
    params: Any = None,
    lora_rank: int | None = None,
    lora_targets: Any = ("q_proj", "v_proj"),
    trainable_fraction: float | None = None,
    base_bits: int = 16,
    tp: int = 1,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    chunked_loss: bool | str = False,
    float8: bool = False,
    reference: str = "none",
    **shape_hints: Any,
) -> MemoryEstimate:
    """Estimate one device's peak memory for a training step (see the module docstring for the bill).

    model_or_spec: a built-in Llama size ("1.5b", "8b", ...), a parameter count (7e9, "7B") or
    params=, a LlamaConfig, a Hugging Face config, or an nn.Module (meta device is fine; `wrap` picks
    its units, default one per element of its largest ModuleList). Shape hints (dim, layers, vocab,
    ffn, heads, kv_heads, tie_embeddings) complete a count or adjust a config. `in_flight` is how many
    inner units are gathered at once (2: the current one and the prefetched one). `device_memory`
    (bytes or '80GiB') only adds a fits / largest-micro-batch line to the printed bill.

    A fine-tune: an nn.Module says what trains through requires_grad (a peft model, say); the other
    forms take `lora_rank` with `lora_targets` (adapters on a frozen base; `base_bits=4`: that base in
    NF4, QLoRA) or `trainable_fraction` (`planning.cost.finetune`). Frozen parameters are billed in their stored dtype, with no gradient and
    no optimizer state, and their layers save only what backward needs through them.

    `tp`: each layer split over `tp` ranks (the world a multiple of it), the TP-local tensors sharded
    over the world / tp data-parallel ranks; `sequence_parallel`: the norms and the residual split
    along the sequence over them too.

    `chunked_loss`: the loss computed in chunks (`st.chunked_cross_entropy`), only a chunk of logits live;
    "auto": chunked where that peaks lower, as `shardtrain train`'s train.chunked_loss auto decides
    (False: the full logits, as `Llama.loss` computes them).

    `float8`: the Linears `Engine(float8=True)` converts train in float8 (`planning.cost.float8_cost`:
    their count in a note, their transient float8 copies in the overhead); not with tp > 1 or base_bits=4.

    `reference`: DPO's reference model, "none" (LoRA, or precomputed log-probabilities) or "frozen_copy"
    (`planning.cost.preference`); give DPO's sequences (two per pair) as `micro_batch`.
    """
    options = resolve_options(strategy=strategy, mixed_precision=precision, cpu_offload=cpu_offload)
    strategy = options.strategy
    world_size = positive_int(world_size, "world_size")
    tp = positive_int(tp, "tp")
    check_tp_divides(tp=tp, world_size=world_size, spelled=f"tp={tp}")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel=True splits activations over the tp ranks: also give tp > 1")
    if loss_parallel and tp == 1:
        raise ValueError("loss_parallel=True splits the logits over the tp ranks: also give tp > 1")
    if chunked_loss not in (True, False, "auto"):
        raise ValueError(f"chunked_loss={chunked_loss!r} is invalid: use True, False or 'auto'")
    _check_float8(float8, tp=tp, base_bits=base_bits)
    optimizer_name, optimizer_state_bytes = optimizer_bytes(optimizer)
    resolved = resolve_model(model_or_spec, params=params, wrap=wrap, **shape_hints)
    model = fine_tune_spec(
        resolved,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        trainable_fraction=trainable_fraction,
        base_bits=base_bits,
    )
    inputs = EstimateInputs(
        model=tp_local_spec(model, tp=tp),
        world_size=world_size,
        strategy=strategy,
        shard_size=shard_size_of(strategy, world_size // tp, shard_size),
        precision=options.precision,
        recompute_every=recompute_every_of(activation_checkpointing),
        offload=options.offload,
        micro_batch=positive_int(micro_batch, "micro_batch"),
        seq_len=positive_int(seq_len, "seq_len"),
        optimizer=optimizer_name,
        optimizer_bytes=optimizer_state_bytes,
        in_flight=positive_int(in_flight, "in_flight"),
        keep_grads=bool(keep_grads),
        device_memory=None if device_memory is None else parse_bytes(device_memory),
        tp=tp,
        sequence_parallel=bool(sequence_parallel),
        loss_parallel=bool(loss_parallel),
        chunked_loss=chunked_loss,
        float8=float8_linears(model_or_spec, resolved) if float8 else None,
    )
    return with_reference(_estimate(inputs), reference=reference)


def _check_float8(float8: Any, *, tp: int, base_bits: int) -> None:
    """The refusals of `Engine(float8=True)` and the training config, for the same combinations."""
    if not isinstance(float8, bool):
        raise ValueError(f"float8={float8!r} is invalid: use True or False")
    if float8 and tp > 1:
        raise ValueError(
            f"float8=True with tp={tp}: the engine trains float8 with tp=1 only; pass tp=1 or float8=False"
        )
    if float8 and base_bits == 4:
        raise ValueError(
            "float8=True with base_bits=4: under a 4-bit base (QLoRA) no Linear would convert (the frozen ones "
            "are NF4, the adapters too small); pass float8=False, or base_bits=16 to keep float8"
        )


def _notes(inputs: EstimateInputs) -> tuple[str, ...]:
    """The model's notes, the tensor-parallel collectives and the frozen parameters' billing."""
    m = inputs.model
    notes = m.notes
    if inputs.tp > 1 and m.shape is not None:
        tokens = inputs.micro_batch * inputs.seq_len
        notes += (
            tp_collectives(
                tp=inputs.tp,
                sequence_parallel=inputs.sequence_parallel,
                tokens=tokens,
                dim=m.shape.dim,
                compute_bytes=inputs.param_bytes,
            ),
        )
    if m.trainable_params < m.num_params:
        notes += (
            f"{m.frozen_params:,} frozen parameters ({inputs.frozen_param_bytes:g} B each as stored): "
            "no gradients or optimizer state",
        )
    if inputs.float8 is not None:
        notes += (inputs.float8.note(inputs.micro_batch * inputs.seq_len),)
    return notes


def _estimate(inputs: EstimateInputs) -> MemoryEstimate:
    """The bill at the step's peak moment: the shared states, each moment's items, the largest total."""
    states = step_states(inputs)
    phases = moments(inputs, states)
    totals = {name: sum(items.values()) for name, items in phases.items()}
    peak = max(totals, key=totals.__getitem__)
    f8 = inputs.float8
    overhead = OVERHEAD_BYTES + (f8.transient_bytes(inputs.micro_batch * inputs.seq_len) if f8 else 0)
    return MemoryEstimate(
        **phases[peak],
        overhead=overhead,
        host=states.host,
        disk=states.disk,
        peak_phase=peak,
        phase_totals=tuple((name, total + overhead) for name, total in totals.items()),
        notes=_notes(inputs),
        inputs=inputs,
    )
