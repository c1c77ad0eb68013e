"""`shardtrain train [CONFIG] [--section.key value ...]`: the main job.

With several local devices the command re-runs itself in one process per device (through the
Engine's launcher); every rank then parses the same arguments and trains its part. A user error
(bad key, missing data, a model that does not build, a batch too small for the world) is printed
by each rank as one line with the fix, and the command exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from typing import Any

from ..train.config import ConfigError, describe, load_config
from ..train.sections import Config


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a model (built-in default: a small Llama on the Python standard library)",
        description="Train a model. Arguments: an optional CONFIG file (.toml or .yaml), then "
        "--section.key value overrides. A model.name of the form 'package.module:function' imports "
        "that module and runs the function: train only with configs you trust.",
        epilog=describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--resume",
        metavar="CHECKPOINT",
        nargs="?",
        const="latest",
        help="resume from a checkpoint directory, or alone (= latest) the run in run.out_dir saved last, "
        "writing on in its run folder (= --run.resume)",
    )
    parser.set_defaults(func=run, overrides=[])


def split_config_path(tokens: list[str]) -> tuple[str | None, list[str]]:
    """The leading CONFIG path (if the first token is not an option) and the overrides after it."""
    if tokens and not tokens[0].startswith("-"):
        return tokens[0], tokens[1:]
    return None, tokens


def _resolve_auto(cfg):
    """engine.strategy='auto': the planner's choice, printed once, by the process that trains as rank 0.

    Returns the config that runs the choice and the command-line overrides that hand it to the ranks
    this process may start (they then run it without planning again)."""
    from ..engine.devices import launched_externally
    from ..train.hub_inputs import fetch_hub_inputs
    from ..train.planned_config import choice_overrides, resolve_auto_config

    given = cfg.model.pretrained
    cfg = fetch_hub_inputs(cfg)  # the planner builds the model from its folder
    fetched = ["--model.pretrained", cfg.model.pretrained] if cfg.model.pretrained != given else []
    planned, choice = resolve_auto_config(cfg)
    if cfg.engine.auto_trials:
        planned = _confirm_by_trials(cfg, choice)
    elif os.environ.get("RANK", "0") == "0" and (launched_externally() or choice.world_size == 1):
        print(choice, flush=True)
    return planned, [*fetched, *choice_overrides(planned)]


def _confirm_by_trials(cfg, choice):
    """engine.auto_trials: time the best predicted configurations, train with the fastest measured.

    Note: the launching process runs the trials; the ranks it starts get the winner as command-line
    overrides (`_resolve_auto`), so they never plan or time again.
    """
    from ..engine.devices import launched_externally
    from ..train.planned_config import apply_choice
    from ..train.trials import fastest, run_trials

    if launched_externally():
        raise ValueError(
            "engine.auto_trials needs `shardtrain train` to start its own processes (each trial runs "
            "in fresh ones); run it without torchrun, or set --engine.auto_trials 0"
        )
    candidates = choice.alternatives()[: cfg.engine.auto_trials]
    print(choice, flush=True)
    print(f"timing {len(candidates)} configuration(s) for a few steps each:", flush=True)
    trials = run_trials(cfg, candidates)
    best = fastest(trials)
    print(f"training with the fastest measured: {best.describe()}", flush=True)
    return apply_choice(cfg, best.choice)


def engine_options(cfg: Config) -> dict[str, Any]:
    """The `Engine` the configuration asks for, as its keyword arguments."""
    return dict(
        devices=cfg.engine.devices,
        accelerator=cfg.engine.accelerator,
        strategy=cfg.engine.strategy,
        precision=cfg.engine.precision,
        cpu_offload=cpu_offload_option(cfg),
        timeout=timedelta(seconds=cfg.engine.timeout),
        compile=cfg.train.compile,
        tp=cfg.engine.tp,
        float8=cfg.train.float8,
    )


def cpu_offload_option(cfg: Config) -> Any:
    """engine.cpu_offload, with the disk tier's directory when engine.offload_dir names one."""
    from ..options import offload_setting

    return offload_setting(cfg.engine.cpu_offload, disk_dir=cfg.engine.offload_dir)


def run(args: argparse.Namespace) -> int:
    path, overrides = split_config_path(args.overrides)
    if args.resume:
        overrides = [*overrides, "--run.resume", args.resume]
    try:
        cfg = load_config(path, overrides)
    except ConfigError as exc:
        print(f"shardtrain train: error: {exc}", file=sys.stderr)
        return 2
    from ..engine import Engine
    from ..train.finetune import check_finetune_config
    from ..train.loop import run as train

    chosen: list[str] = []
    try:
        check_finetune_config(cfg)  # before any process starts (the loop checks it again on every rank)
        if cfg.engine.strategy == "auto":
            cfg, chosen = _resolve_auto(cfg)
        engine = Engine(**engine_options(cfg))
    except ValueError as exc:
        print(f"shardtrain train: error: {exc}", file=sys.stderr)
        return 2
    engine.launch(relaunch_args=chosen)
    try:
        summary = train(cfg, engine)
    except ValueError as exc:
        return _stop(exc, line=f"error on rank {engine.rank}: {exc}", reason=str(exc), code=1)
    except KeyboardInterrupt as exc:
        return _stop(exc, line=None, reason="interrupted", code=130)
    except Exception as exc:
        from ..engine.health import explain

        # A failed collective: name the rank responsible, where the heartbeats in the store can tell.
        why = explain(exc, timeout_s=cfg.engine.timeout) if isinstance(exc, RuntimeError) else None
        if why is None:
            _stop(exc, line=None, reason=f"{type(exc).__name__}: {exc}", code=1)
            raise  # not understood: the traceback is the report
        return _stop(exc, line=f"rank {engine.rank} stopped: {why}", reason=why, code=1)
    if engine.rank == 0:
        from rich.console import Console

        Console().print(summary.table())
    return 0  # Note: the ranks finish together at exit (engine.devices._destroy_process_group)


def _stop(exc: BaseException, *, line: str | None, reason: str, code: int) -> int:
    """This rank stops on `exc`: print `line` (if any), leave `reason` in the store for its peers'
    messages (engine.health), and skip the exit barrier (the peers are not coming)."""
    from ..engine.devices import mark_failed
    from ..engine.health import report_failure

    if line is not None:
        print(f"shardtrain train: {line}", file=sys.stderr, flush=True)
    report_failure(reason)
    mark_failed(exc)
    return code
