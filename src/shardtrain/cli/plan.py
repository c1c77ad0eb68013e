"""`shardtrain plan`: what `shardtrain train` would run, without training.

From the same config and overrides, with the model built on the meta device (no GPU, no process
group), it prints the wrap plan, the precision audit and the memory estimate, after the automatic
plan and its reasons with --auto; the whole usage is the command's --help (`HELP`).
"""

from __future__ import annotations

import argparse
import sys

from ..train.config import load_config
from ..train.plan_report import plan_report
from .train import split_config_path

# The command's --help text.
HELP = """`shardtrain plan [CONFIG] [--section.key value ...]`: what `shardtrain train` would run, without training.

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


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show the wrap plan and memory estimate of a training config, without training",
        description=HELP,
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


def report(args: argparse.Namespace) -> str:
    """The whole printout; ConfigError / ValueError carry the user's mistakes."""
    path, overrides = split_config_path(args.overrides)
    return plan_report(load_config(path, overrides), auto=args.auto, device_memory=args.device_memory)


def run(args: argparse.Namespace) -> int:
    try:
        text = report(args)
    except ValueError as exc:  # ConfigError included
        print(f"shardtrain plan: error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0
