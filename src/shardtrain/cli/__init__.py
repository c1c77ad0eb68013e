"""`shardtrain` command line: one subcommand per module `shardtrain.cli.<name>`.

Each module exposes `register(subparsers)`, which adds its parser and sets `func` (called with the
parsed arguments; its return value is the exit code). A subcommand that takes free-form
`--section.key value` overrides sets the default `overrides=[]`; the unparsed arguments land there.

Subcommands are imported one by one: a module missing from this build (or failing to import)
leaves its subcommand answering with that reason instead of breaking the whole command line.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "train": "train a model (built-in default: a small Llama on the Python standard library)",
    "plan": "show the wrap plan and memory estimate of a training config, without training",
    "estimate": "the per-device memory bill of each sharding strategy",
    "bench": "benchmark this engine against DDP and torch FSDP",
    "convert": "convert a sharded checkpoint into one full safetensors file",
}


def _register_unavailable(subparsers, name: str, reason: str) -> None:
    parser = subparsers.add_parser(name, help=f"{SUBCOMMANDS[name]} [not available: {reason}]", add_help=False)

    def unavailable(_args: argparse.Namespace) -> int:
        print(f"shardtrain {name}: not available yet in this build ({reason})", file=sys.stderr)
        return 2

    parser.set_defaults(func=unavailable, overrides=[])  # accept any arguments: the answer is the same


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardtrain", description="Fully sharded data-parallel training for PyTorch.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ImportError as exc:
            missing = exc.name == f"{__name__}.{name}"
            _register_unavailable(
                subparsers, name, f"module {__name__}.{name} is missing" if missing else f"{type(exc).__name__}: {exc}"
            )
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if hasattr(args, "overrides"):
        args.overrides = extra
    return args.func(args) or 0
