"""strategy="auto": the fastest configuration predicted to fit, and the reasons for it.

`choose_plan` is the one function that chooses a plan: it weighs every strategy, activation
checkpointing and micro-batch split (CPU offload and the disk tier only when nothing fits without
them), prices each with the memory estimator (`candidates`) and the cost model (`speed`), and returns
the fastest that fits with a safety margin, as an `AutoChoice` (`choice`). Its callers (`st.shard_auto`,
`engine.strategy = "auto"`) only translate their inputs. The order of weighing, the ties and the
margin: docs/design.md, Note [Choosing a plan].
"""

from __future__ import annotations

from typing import Any

from ...strategy import Strategy
from .candidates import Candidate, batch_splits, evaluate, parse_strategies
from .choice import AutoChoice
from .estimate import estimate_memory, positive_int
from .explain import explain
from .machine import plan_memory
from .sizes import format_gib, parse_bytes
from .speed import StepTime, step_time

DEFAULT_STRATEGIES = ("full_shard", "shard_grad_op", "optimizer_only", "no_shard")
SAFETY_MARGIN = 0.05  # covers the estimator's error against measured peaks (module docstring)
RUNNERS_UP = 4  # fitting configurations kept after the best, for timed trials
OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # shares of the model weighed for CPU offload (whole units)
_SEARCH_STEPS = 10  # remedies when nothing fits: up to 2**10 x the devices, down to seq_len / 2**10


def _sequences_per_rank(
    *, world_size: int, seq_len: int, global_batch_tokens: int | None, micro_batch: int | None, grad_accum: int
) -> int:
    if global_batch_tokens is None:
        if micro_batch is None:
            raise ValueError(
                "no batch given: pass global_batch_tokens= (tokens per optimizer step over all devices) "
                "or micro_batch= (sequences per device per micro-step) with grad_accum="
            )
        return positive_int(micro_batch, "micro_batch") * positive_int(grad_accum, "grad_accum")
    if micro_batch is not None:
        raise ValueError(
            f"global_batch_tokens={global_batch_tokens} and micro_batch={micro_batch} both give the "
            "batch; pass one of them"
        )
    per_rank, rest = divmod(positive_int(global_batch_tokens, "global_batch_tokens"), world_size * seq_len)
    if rest or not per_rank:
        unit = world_size * seq_len
        raise ValueError(
            f"global_batch_tokens={global_batch_tokens:,} is not a multiple of world_size {world_size} x "
            f"seq_len {seq_len} = {unit:,} tokens; use {max(1, per_rank) * unit:,}"
        )
    return per_rank


def _smallest_needed(model: Any, *, world_size: int, seq_len: int, offload: bool, kwargs: dict[str, Any]) -> int:
    e = estimate_memory(
        model,
        world_size=world_size,
        seq_len=seq_len,
        strategy="full_shard",
        activation_checkpointing=True,
        cpu_offload=offload,
        micro_batch=1,
        **kwargs,
    )
    return e.total + e.reserve


def _nothing_fits(
    model: Any,
    candidates: list[Candidate],
    *,
    world_size: int,
    seq_len: int,
    memory: int,
    usable: int,
    safety_margin: float,
    offload: bool,
    kwargs: dict[str, Any],
    host_usable: int | None = None,
    disk_dir: str | None = None,
) -> ValueError:
    """What to change when no candidate fits: more devices, shorter sequences, or bigger devices."""
    smallest = min(candidates, key=lambda c: c.needed)
    remedies = []
    if host_usable is not None:
        remedies.append(
            f"more host memory per process (offloading more of the model needs more than the "
            f"{format_gib(host_usable)} GiB usable here)"
        )
        if disk_dir is None:
            remedies.append("a disk directory for the offloaded optimizer state (disk_dir=, --engine.offload_dir)")
    for step in range(1, _SEARCH_STEPS + 1):
        world = world_size << step
        if _smallest_needed(model, world_size=world, seq_len=seq_len, offload=offload, kwargs=kwargs) <= usable:
            remedies.append(
                f"use at least {world} devices (predicted to fit with full_shard, every block "
                f"checkpointed, micro-batch 1{', CPU offload' if offload else ''})"
            )
            break
    for step in range(1, _SEARCH_STEPS + 1):
        seq = seq_len >> step
        if (
            seq
            and _smallest_needed(model, world_size=world_size, seq_len=seq, offload=offload, kwargs=kwargs) <= usable
        ):
            remedies.append(f"shorten seq_len to {seq}")
            break
    remedies.append(f"use devices with at least {format_gib(smallest.needed / (1 - safety_margin))} GiB")
    if not offload:
        remedies.append("allow CPU offload")
    weighed = "the device alone" + ", CPU offload to the host" * offload
    if offload and disk_dir is not None:
        weighed += f", CPU offload with the optimizer state on disk in {disk_dir}"
    return ValueError(
        f"nothing fits in {format_gib(memory)} GiB per device ({format_gib(usable)} GiB usable with the "
        f"{safety_margin:.0%} safety margin; weighed: {weighed}): the smallest configuration weighed, "
        f"{smallest.describe()}, needs {format_gib(smallest.needed)} GiB. To fit: {'; or '.join(remedies)}"
    )


def _budget(
    *,
    device_memory: int | str | None,
    host_memory: int | str | None,
    disk_dir: str | None,
    world_size: int,
    accelerator: str | None,
    processes: int,
    safety_margin: float,
) -> tuple[int, int, int | None]:
    """(device memory, its usable part, the host's usable part or None: unchecked), this machine's
    where `accelerator` is given and the memory is not (`machine.plan_memory`)."""
    if accelerator is not None:
        device_memory, host_memory = plan_memory(
            device_memory=device_memory,
            host_memory=host_memory,
            disk_dir=disk_dir,
            world_size=world_size,
            accelerator=accelerator,
            processes=processes,
        )
    if device_memory is None:
        raise ValueError(
            "device_memory=None: give each device's memory (e.g. '80GiB'), or accelerator= to read this machine's"
        )
    memory = parse_bytes(device_memory, what="device_memory")
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin={safety_margin!r} must be a fraction in [0, 1), e.g. 0.05")
    usable = int(memory * (1 - safety_margin))
    if host_memory is None:
        return memory, usable, None
    return memory, usable, int(parse_bytes(host_memory, what="host_memory") * (1 - safety_margin))


def _splits(sequences: int, *, split_batch: bool, micro_batch: int | None, grad_accum: int) -> list[tuple[int, int]]:
    """The micro_batch x grad_accum splits of each rank's sequences weighed (without `split_batch`: the given one)."""
    if split_batch:
        return batch_splits(sequences)
    return [(sequences, 1)] if micro_batch is None else [(micro_batch, grad_accum)]


def _weigh(
    model_spec: Any,
    *,
    common: dict[str, Any],
    usable: int,
    host_usable: int | None,
    allow_offload: bool,
    disk_dir: str | None,
) -> tuple[list[Candidate], list[Candidate]]:
    """Every candidate weighed, and apart the offloaded ones whose host share does not fit the host.

    The device alone first; CPU offload (every share at once) only when nothing fits without it; the
    disk tier (`disk_dir`) only when nothing fits with device and host memory either."""
    candidates = evaluate(model_spec, cpu_offload=0.0, **common)
    too_big_for_host: list[Candidate] = []
    stages: list[list[dict[str, Any]]] = [[dict(cpu_offload=fraction) for fraction in OFFLOAD_FRACTIONS]]
    if disk_dir is not None:
        stages.append([dict(cpu_offload=1.0, disk_dir=disk_dir)])
    for stage in stages if allow_offload else ():
        if any(c.needed <= usable for c in candidates):
            break
        for tier in stage:
            for c in evaluate(model_spec, **tier, **common):
                fits_host = host_usable is None or c.host_bytes <= host_usable
                (candidates if fits_host else too_big_for_host).append(c)
    return candidates, too_big_for_host


def _baseline(best: Candidate, *, world_size: int, seq_len: int) -> StepTime | None:
    """full_shard with every block checkpointed at the best's batch split: what the reasons compare with."""
    inputs = best.estimate.inputs
    spec = inputs.model
    if spec.shape is None:
        return None
    return step_time(
        model=spec,
        strategy=Strategy.FULL_SHARD,
        shard_size=world_size,
        checkpointed_blocks=spec.shape.n_layers,
        micro_batch=best.micro_batch,
        grad_accum=best.grad_accum,
        seq_len=seq_len,
        float8=inputs.float8 is not None,
    )


def choose_plan(
    model_spec: Any,
    /,
    *,
    world_size: int,
    device_memory: int | str | None,
    seq_len: int,
    global_batch_tokens: int | None = None,
    micro_batch: int | None = None,
    grad_accum: int = 1,
    precision: Any = "bf16",
    optimizer: Any = "adamw",
    strategies: tuple[Any, ...] | list[Any] = DEFAULT_STRATEGIES,
    split_batch: bool = True,
    allow_offload: bool = True,
    safety_margin: float = SAFETY_MARGIN,
    host_memory: int | str | None = None,
    disk_dir: str | None = None,
    wrap: Any = None,
    accelerator: str | None = None,
    processes: int = 1,
    **shape_hints: Any,
) -> AutoChoice:
    """The fastest configuration of `model_spec` predicted to fit on `world_size` devices (module docstring).

    model_spec: anything `st.estimate_memory` takes (a built-in size such as "8b", a parameter count,
    a LlamaConfig, a Hugging Face config, an nn.Module on any device; `wrap` and shape hints as there).
    A fine-tune is planned as one: a module's requires_grad says what trains (a peft model), or
    `lora_rank=` / `lora_targets=` / `trainable_fraction=` pass through to `st.estimate_memory`.
    The batch: `global_batch_tokens` (over all devices, per optimizer step), or `micro_batch` sequences
    per device with `grad_accum`. With `split_batch`, each device's sequences may be regrouped into
    any micro_batch x grad_accum of the same product; without, the given split is kept. `host_memory`
    (per process) bounds what CPU offload may put on the host (None: not checked). `disk_dir` (an
    existing directory) lets the plan keep the optimizer state of a fully offloaded model there, when
    nothing fits with device and host memory alone.
    `accelerator` ("cuda" or "cpu") plans for this machine: device_memory=None becomes each of its
    `processes` local processes' share of it, and host_memory=None this host's share per process when
    device_memory is None or `disk_dir` is given (`machine.plan_memory`); without `accelerator`
    nothing is looked up here and device_memory is required.
    Raises ValueError naming what to change (more devices, shorter sequences, ...) if nothing fits.
    """
    world_size = positive_int(world_size, "world_size")
    seq_len = positive_int(seq_len, "seq_len")
    memory, usable, host_usable = _budget(
        device_memory=device_memory,
        host_memory=host_memory,
        disk_dir=disk_dir,
        world_size=world_size,
        accelerator=accelerator,
        processes=processes,
        safety_margin=safety_margin,
    )
    sequences = _sequences_per_rank(
        world_size=world_size,
        seq_len=seq_len,
        global_batch_tokens=global_batch_tokens,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
    )
    splits = _splits(sequences, split_batch=split_batch, micro_batch=micro_batch, grad_accum=grad_accum)
    kwargs = dict(precision=precision, optimizer=optimizer, wrap=wrap, **shape_hints)
    common = dict(
        world_size=world_size,
        strategies=parse_strategies(strategies),
        splits=splits,
        seq_len=seq_len,
        estimate_kwargs=kwargs,
    )
    candidates, too_big_for_host = _weigh(
        model_spec,
        common=common,
        usable=usable,
        host_usable=host_usable,
        allow_offload=allow_offload,
        disk_dir=disk_dir,
    )
    fits = [c for c in candidates if c.needed <= usable]
    if not fits:
        raise _nothing_fits(
            model_spec,
            candidates,
            world_size=world_size,
            seq_len=seq_len,
            memory=memory,
            usable=usable,
            safety_margin=safety_margin,
            offload=allow_offload,
            kwargs=kwargs,
            host_usable=host_usable if too_big_for_host else None,
            disk_dir=disk_dir,
        )
    ranked = sorted(fits, key=lambda c: (c.time.total, c.needed))  # stable: ties keep the strategies' order
    best = ranked[0]
    reasons = explain(
        best=best,
        candidates=candidates,
        memory=memory,
        usable=usable,
        safety_margin=safety_margin,
        global_tokens=sequences * world_size * seq_len,
        fixed_batch=len(splits) == 1,
        baseline=_baseline(best, world_size=world_size, seq_len=seq_len),
        host_rejected=too_big_for_host,
        host_usable=host_usable,
    )
    return AutoChoice.of(
        best,
        runners_up=tuple(ranked[1 : RUNNERS_UP + 1]),
        seq_len=seq_len,
        world_size=world_size,
        device_memory=memory,
        usable_memory=usable,
        reasons=reasons,
    )
