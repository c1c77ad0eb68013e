"""The planner's view of a training config, and `engine.strategy = "auto"` for the main job.

`planned_setup(cfg)` reads what a Config asks of each device the way `shardtrain train` resolves it,
so `shardtrain plan` describes the run that `shardtrain train` starts, from the same config.
`resolve_auto_config(cfg)` replaces strategy "auto" by `planning.cost.auto.choose_plan`'s choice,
keeping the global batch; the returned config is what the run saves as its config.yaml, so rerunning
that file repeats the choice without planning again. What changes and why:
docs/design.md, Note [Auto strategy of a training config].
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass

import torch

from ..engine.devices import launched_externally, resolve_topology
from ..options import offload_setting, precision_name, resolve_options
from ..planning.cost.auto import choose_plan
from ..planning.cost.choice import AutoChoice
from ..tp.mesh import check_tp_divides
from ..tp.refusals import refuse_auto
from .dpo_section import dpo_reference
from .finetune import build_dtype, check_finetune_config, describe_lora, with_lora
from .loop import check_batch
from .model_builder import BuiltModel, build_model
from .sections import Config, ConfigError, EngineConfig

AUTO = "auto"


@dataclass(frozen=True, kw_only=True)
class PlannedSetup:
    """What one device of the run does, as `shardtrain train` will resolve the config."""

    accelerator: str  # "cuda" | "cpu"
    world_size: int
    strategy: str  # may be "auto" (not yet resolved)
    precision: str  # as the Engine resolves "auto": bf16-mixed on CUDA, 32-true on CPU
    micro_batch: int  # sequences per device per micro-step
    grad_accum: int
    seq_len: int
    activation_checkpointing: bool | int  # True: every block, k: 1 block in k
    cpu_offload: bool | float  # a float: the share of the parameters offloaded
    offload_dir: str | None = None  # the disk tier's directory for the offloaded optimizer state
    tp: int = 1  # ranks each layer is split over (the data-parallel ranks: world_size // tp)
    sequence_parallel: bool = False
    loss_parallel: bool = False


def _target(engine: EngineConfig) -> tuple[str, int]:
    """(accelerator, world size) of the run, without starting it."""
    if engine.devices == AUTO and not launched_externally():
        try:
            topology = resolve_topology(accelerator=engine.accelerator, devices=AUTO)
        except ValueError as exc:
            raise ConfigError(f"{exc}; to plan for devices elsewhere, give their number: --engine.devices N") from exc
        return topology.accelerator, topology.num_processes
    accelerator = engine.accelerator
    if accelerator == AUTO:
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if launched_externally():
        return accelerator, int(os.environ["WORLD_SIZE"])
    if isinstance(engine.devices, bool) or not isinstance(engine.devices, int) or engine.devices < 1:
        raise ConfigError(f"engine.devices={engine.devices!r} is invalid: use 'auto' or a positive number of processes")
    return accelerator, engine.devices


def planned_setup(cfg: Config) -> PlannedSetup:
    """The per-device setup of `cfg` (see the module docstring); ConfigError for a batch that cannot split."""
    accelerator, world_size = _target(cfg.engine)
    precision = precision_name(cfg.engine.precision, accelerator=accelerator)
    tp = cfg.engine.tp
    try:
        check_tp_divides(tp=tp, world_size=world_size, spelled=f"engine.tp={tp}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        global_micro_batch = check_batch(cfg, world_size // tp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return PlannedSetup(
        accelerator=accelerator,
        world_size=world_size,
        strategy=cfg.engine.strategy,
        precision=precision,
        micro_batch=global_micro_batch // (world_size // tp),
        grad_accum=cfg.train.grad_accum,
        seq_len=cfg.data.seq_len,
        activation_checkpointing=cfg.model.activation_checkpointing,
        cpu_offload=cfg.engine.cpu_offload,
        offload_dir=cfg.engine.offload_dir,
        tp=tp,
        sequence_parallel=cfg.engine.sequence_parallel,
        loss_parallel=cfg.engine.loss_parallel,
    )


def build_on_meta(cfg: Config, *, precision: str) -> BuiltModel:
    """The configured model on the meta device as `shardtrain train` builds it under `precision`: shapes,
    dtypes, units and what trains (a LoRA base in its build dtype, with peft's adapters), no memory."""
    try:
        check_finetune_config(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    with torch.device("meta"):
        built = build_model(
            cfg.model,
            init_context=lambda empty_init=True: contextlib.nullcontext(),
            dtype=build_dtype(cfg, resolve_options(mixed_precision=precision).precision),
        )
    if not cfg.lora.rank:
        return built
    model, _ = with_lora(cfg, built.module)
    return dataclasses.replace(built, module=model, description=describe_lora(cfg, model, built.description))


def apply_choice(cfg: Config, choice: AutoChoice) -> Config:
    """`cfg` with the automatic plan's strategy, checkpointing, offload (and disk tier) and accumulation."""
    return dataclasses.replace(
        cfg,
        engine=dataclasses.replace(
            cfg.engine,
            strategy=choice.strategy.value,
            cpu_offload=offload_setting(choice.cpu_offload),
            offload_dir=choice.disk_dir,
        ),
        model=dataclasses.replace(cfg.model, activation_checkpointing=choice.activation_checkpointing),
        train=dataclasses.replace(cfg.train, grad_accum=choice.grad_accum),
    )


def choice_overrides(cfg: Config) -> list[str]:
    """`--section.key value` overrides that set what `apply_choice` set in `cfg` (and no timed trials):
    appended to the command the ranks re-run, they train the choice without planning again."""
    values = {
        "engine.strategy": cfg.engine.strategy,
        "engine.cpu_offload": cfg.engine.cpu_offload,
        "engine.offload_dir": cfg.engine.offload_dir,
        "engine.auto_trials": 0,
        "model.activation_checkpointing": cfg.model.activation_checkpointing,
        "train.grad_accum": cfg.train.grad_accum,
    }
    return [arg for key, value in values.items() for arg in (f"--{key}", _command_line(value))]


def _command_line(value: str | bool | int | float | None) -> str:
    return value if isinstance(value, str) else json.dumps(value)  # None: "null", which the reader takes


def resolve_auto_config(
    cfg: Config, *, device_memory: int | None = None, built: BuiltModel | None = None
) -> tuple[Config, AutoChoice]:
    """Choose the fastest configuration predicted to fit and return the config that runs it, and the choice.

    The config's request to `choose_plan` (the one function that chooses), read the way `shardtrain
    train` resolves it; nothing is chosen here.

    `device_memory` defaults to the local device's (the GPU's; on the CPU, the host's share per
    process). `built` reuses a model already built on the meta device. Raises ValueError (or
    ConfigError) naming what to change when nothing fits or the model has no blocks to plan with.
    """
    setup = planned_setup(cfg)
    refuse_auto(auto=True, tp=setup.tp > 1, spelled=f"engine.tp={setup.tp}")
    built = built or build_on_meta(cfg, precision=setup.precision)
    if not built.wrap:
        raise ConfigError(
            f"engine.strategy='auto' needs the model's block classes, and {cfg.model.name!r} names none; "
            "give them with --model.wrap ClassName"
        )
    choice = choose_plan(
        built.module,
        world_size=setup.world_size,
        device_memory=device_memory,
        seq_len=setup.seq_len,
        micro_batch=setup.micro_batch * (2 if cfg.train.objective == "dpo" else 1),  # DPO: two rows a pair
        grad_accum=setup.grad_accum,
        reference=dpo_reference(cfg),
        float8=cfg.train.float8,
        precision=setup.precision,
        disk_dir=cfg.engine.offload_dir,
        wrap=built.wrap,
        accelerator=setup.accelerator,
        processes=setup.world_size,
    )
    return apply_choice(cfg, choice), choice
