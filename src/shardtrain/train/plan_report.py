"""The plan of a run as `shardtrain plan` prints it: the wrap plan, the precision audit and the memory
estimate of a training config, from the model built on the meta device (no GPU, no process group).

`shardtrain plan` prints it; `shardtrain train` hands it to the run's trackers at start-up, so a run's
record holds what it was predicted to need.
"""

from __future__ import annotations

from ..options import offload_setting
from ..planning.cost.candidates import accumulation_bytes, offload_label, offload_work, predicted_time
from ..planning.cost.compare import default_shard_size
from ..planning.cost.estimate import estimate_memory
from ..planning.cost.inputs import recompute_every_of, tp_label
from ..planning.cost.machine import local_device_memory
from ..planning.cost.report import checkpointing_label
from ..planning.cost.sizes import format_gib, parse_bytes
from ..planning.dry_run.audit import audit_precision
from ..planning.dry_run.units import plan
from ..strategy import parse_strategy
from .planned_config import AUTO, PlannedSetup, build_on_meta, planned_setup, resolve_auto_config
from .sections import Config


def _section(title: str, body: object) -> str:
    return f"\n== {title} ==\n{body}"


def _device_memory(given: str | None, setup: PlannedSetup) -> tuple[int | None, str]:
    if given:
        return parse_bytes(given, what="--device-memory"), "given"
    try:
        return local_device_memory(accelerator=setup.accelerator, processes=setup.world_size)
    except ValueError as exc:
        return None, str(exc)


def _header(description: str, setup: PlannedSetup) -> str:
    checkpointing = checkpointing_label(recompute_every_of(setup.activation_checkpointing))
    offload = offload_label(float(setup.cpu_offload), disk=setup.offload_dir is not None)
    return (
        f"shardtrain plan: {description}\n{setup.world_size} x {setup.accelerator}, {setup.strategy}, "
        f"{setup.precision}, micro-batch {setup.micro_batch} x {setup.grad_accum} accumulation "
        f"step{'s' * (setup.grad_accum > 1)}, seq "
        f"{setup.seq_len}, activation checkpointing {checkpointing}{offload}"
        f"{tp_label(setup.tp, sequence_parallel=setup.sequence_parallel, loss_parallel=setup.loss_parallel)}"
    )


def plan_report(cfg: Config, *, auto: bool = False, device_memory: str | None = None) -> str:
    """The whole printout for `cfg` (`auto`: choose the automatic plan first; `device_memory`: e.g. "80GB",
    else the local device's); ValueError carries the user's mistakes."""
    setup = planned_setup(cfg)
    memory, source = _device_memory(device_memory, setup)
    built = build_on_meta(cfg, precision=setup.precision)
    parts = []
    if auto or setup.strategy == AUTO:
        if memory is None:
            raise ValueError(f"the automatic plan needs the device memory: {source}")
        cfg, choice = resolve_auto_config(cfg, device_memory=memory, built=built)
        setup = planned_setup(cfg)
        parts.append(_section("automatic plan", choice))
    strategy = parse_strategy(setup.strategy)
    model, wrap = built.module, built.wrap
    estimate = estimate_memory(
        model,
        wrap=wrap,
        world_size=setup.world_size,
        strategy=strategy,
        precision=setup.precision,
        shard_size=default_shard_size(setup.world_size) if strategy.is_hybrid else None,
        activation_checkpointing=setup.activation_checkpointing,
        cpu_offload=offload_setting(cfg.engine.cpu_offload, disk_dir=cfg.engine.offload_dir),
        micro_batch=setup.micro_batch,
        seq_len=setup.seq_len,
        device_memory=memory,
        tp=setup.tp,
        sequence_parallel=setup.sequence_parallel,
        loss_parallel=setup.loss_parallel,
        chunked_loss=cfg.train.chunked_loss if setup.tp == 1 else False,  # train/chunked_choice.py
        float8=cfg.train.float8,
    )
    held = accumulation_bytes(estimate, grad_accum=setup.grad_accum)
    bill = str(estimate)
    if held:
        bill += (
            f"\n+ {format_gib(held)} GiB: with {setup.grad_accum} micro-batches, no_sync holds the unsharded "
            "gradients between them (not in the table above)"
        )
    bill += f"\ndevice memory: {f'{format_gib(memory)} GiB' if memory else 'unknown'} ({source})"
    work = offload_work(estimate)
    if work is not None and setup.tp == 1:
        bill += (
            f"\npredicted step time with CPU offload, host step {work.host_step.value} (planning/cost/offload_time.py): "
            f"{predicted_time(estimate, grad_accum=setup.grad_accum).describe()}"
        )
    parts += [
        _section(
            "wrap plan",
            plan(model, wrap=wrap, world_size=setup.world_size, strategy=strategy, mixed_precision=setup.precision),
        ),
        _section(
            "precision audit",
            audit_precision(
                model, wrap=wrap, strategy=strategy, mixed_precision=setup.precision, cpu_offload=setup.cpu_offload
            ),
        ),
        _section("memory estimate per device", bill),
    ]
    return _header(built.description, setup) + "\n" + "\n".join(parts)
