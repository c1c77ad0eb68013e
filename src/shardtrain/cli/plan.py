"""`shardtrain plan [CONFIG] [--section.key value ...]`: what `shardtrain train` would run, without training.

Takes the same config file and overrides as `shardtrain train`, builds the model on the meta device
(no GPU, no process group, no memory) and prints, for the run as the train command resolves it:

  - the wrap plan: the sharding units, their parameters and bytes (st.plan);
  - the precision audit: the dtype of parameters, gradients, reductions, optimizer state and buffers
    of every unit, as st.shard will make them;
  - the memory estimate per device (st.estimate_memory), with whether it fits; with CPU offload, the
    predicted step time, the disk tier's reads and writes included when engine.offload_dir is set.

With --auto, or engine.strategy = "auto" in the config, the automatic plan is chosen first and printed
with its reasons; the rest then describes the chosen run.

    shardtrain plan
    shardtrain plan run.toml --engine.devices 2 --engine.precision bf16-mixed --device-memory 141GB
    shardtrain plan --auto --model.name llama-8b --engine.devices 2 --engine.precision bf16-mixed \\
        --data.seq_len 4096 --train.batch_size 4 --device-memory 141GB

Device memory: --device-memory, else the local GPU's when the run targets CUDA, else (CPU runs) the
host's memory split between the processes. Planning a CUDA run on a machine without one needs
--device-memory for --auto; without --auto the fit is then not judged.
"""

from __future__ import annotations

import argparse
import sys

from ..planning.audit import audit_precision
from ..planning.candidates import accumulation_bytes, offload_label, offload_work, predicted_time
from ..planning.compare import default_shard_size
from ..planning.dry_run import plan
from ..planning.estimate import estimate_memory
from ..planning.inputs import recompute_every_of, tp_label
from ..planning.machine import local_device_memory
from ..planning.report import checkpointing_label
from ..planning.sizes import format_gib, parse_bytes
from ..strategy import parse_strategy
from ..train.config import load_config
from ..train.planned_config import AUTO, PlannedSetup, build_on_meta, planned_setup, resolve_auto_config
from .train import cpu_offload_option, split_config_path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show the wrap plan and memory estimate of a training config, without training",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--auto",
        action="store_true",
        help="choose strategy, checkpointing, offload and micro-batch automatically (= --engine.strategy auto)",
    )
    parser.add_argument("--device-memory", help="memory per device, e.g. 141GB, 80GiB (default: the local device's)")
    parser.set_defaults(func=run, overrides=[])


def _section(title: str, body: object) -> str:
    return f"\n== {title} ==\n{body}"


def _device_memory(args: argparse.Namespace, setup: PlannedSetup) -> tuple[int | None, str]:
    if args.device_memory:
        return parse_bytes(args.device_memory, what="--device-memory"), "given"
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


def report(args: argparse.Namespace) -> str:
    """The whole printout; ConfigError / ValueError carry the user's mistakes."""
    path, overrides = split_config_path(args.overrides)
    cfg = load_config(path, overrides)
    setup = planned_setup(cfg)
    memory, source = _device_memory(args, setup)
    built = build_on_meta(cfg, precision=setup.precision)
    parts = []
    if args.auto or setup.strategy == AUTO:
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
        cpu_offload=cpu_offload_option(cfg),  # engine.cpu_offload, with the disk tier of engine.offload_dir
        micro_batch=setup.micro_batch,
        seq_len=setup.seq_len,
        device_memory=memory,
        tp=setup.tp,
        sequence_parallel=setup.sequence_parallel,
        loss_parallel=setup.loss_parallel,
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
            f"\npredicted step time with CPU offload, host step {work.host_step.value} (planning/offload_time.py): "
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


def run(args: argparse.Namespace) -> int:
    try:
        text = report(args)
    except ValueError as exc:  # ConfigError included
        print(f"shardtrain plan: error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0
