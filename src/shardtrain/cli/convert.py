"""`shardtrain convert CKPT OUT`: a sharded checkpoint as one full safetensors file.

Runs in one process, without a process group, streaming one unit at a time. OUT ending in
`.safetensors` is that file; any other OUT is a folder for transformers' `from_pretrained`
(config.json + model.safetensors), using --hf-config or the config the checkpoint recorded.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a sharded checkpoint into one full safetensors file",
        description="Convert a sharded checkpoint (any world size) into one full safetensors file whose tensors "
        "load into the plain model with model.load_state_dict(safetensors.torch.load_file(OUT)).",
    )
    parser.add_argument(
        "checkpoint", metavar="CKPT", help="checkpoint directory, or a directory with a 'latest' pointer"
    )
    parser.add_argument("out", metavar="OUT", help="OUT.safetensors, or a folder for a Hugging Face model")
    parser.add_argument("--module", default=None, help="state key of the model to convert (default: the only one)")
    parser.add_argument(
        "--hf-config",
        default=None,
        metavar="CONFIG",
        help="a Hugging Face config.json (or its folder): write OUT as a from_pretrained folder",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint.convert import convert_checkpoint

    try:
        done = convert_checkpoint(args.checkpoint, args.out, module=args.module, hf_config=args.hf_config)
    except ValueError as exc:
        print(f"shardtrain convert: error: {exc}", file=sys.stderr)
        return 2
    size = done.weights.stat().st_size / 2**20
    extra = f" and {done.config}" if done.config is not None else ""
    print(f"wrote {done.weights} ({done.tensors} tensors, {size:.1f} MiB){extra}")
    return 0
