"""`shardtrain estimate`: the per-device memory bill of each sharding strategy, side by side.

For a built-in Llama size, a Hugging Face config or a parameter count, full training or a fine-tune,
with the largest micro-batch that fits the device's memory; the whole usage is the command's --help
(`HELP`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from ..models.llama import LLAMA_SIZES
from ..planning.cost.compare import DEFAULT_STRATEGIES, compare_strategies
from ..planning.cost.estimate import MemoryEstimate
from ..planning.cost.machine import local_device_memory
from ..planning.cost.sizes import GiB, format_gib, parse_bytes
from ..policy import CPUOffload

# The command's --help text.
HELP = """`shardtrain estimate`: the per-device memory bill of each sharding strategy, side by side.

    shardtrain estimate --params 7B --gpus 4
    shardtrain estimate --model 8b --gpus 2 --ac all --device-memory 141GB
    shardtrain estimate --model path/to/config.json --gpus 8 --strategy full_shard
    shardtrain estimate --model path/to/hf_model_dir --gpus 1 --lora-rank 8 --lora-targets q_proj,v_proj
    shardtrain estimate --model 8b --gpus 2 --offload --offload-dir /mnt/nvme/state

The model is a built-in Llama size, a Hugging Face config.json (or the folder holding it), or a
parameter count (--params) with optional shape hints. A fine-tune: --lora-rank R (adapters on
--lora-targets, the base frozen in the compute dtype, as `shardtrain train --lora.rank` builds it, or in
NF4 with --lora-base-bits 4) or --trainable FRACTION; frozen parameters have no gradient and no optimizer
state. The largest micro-batch is computed for --device-memory, by default the local GPU's memory, or 80 GiB where there is none (the output says which). Below the bill, one line per
strategy shows the textbook arithmetic of the model states: fp32 parameters + fp32 gradients +
optimizer state (16 B/param for AdamW), divided by the ranks a shard spans.
"""

FALLBACK_DEVICE_MEMORY = 80 * GiB
PRECISIONS = ("bf16", "fp16", "fp32")


def _checkpointing(text: str) -> bool | int:
    key = text.strip().lower()
    if key in ("none", "no", "0"):
        return False
    if key in ("all", "full", "1"):
        return True
    if key.isdigit():
        return int(key)
    raise argparse.ArgumentTypeError(f"--ac {text!r}: use none, all, or k (every k-th block), e.g. --ac 2")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="the per-device memory bill of each sharding strategy",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    what = parser.add_argument_group("model (one of --model / --params)")
    what.add_argument("--model", help=f"built-in size ({', '.join(LLAMA_SIZES)}) or a Hugging Face config.json")
    what.add_argument("--params", help="parameter count, e.g. 7B, 1.5b, 350M (Llama-style shape derived)")
    for hint in ("dim", "layers", "vocab", "ffn", "heads", "kv-heads"):
        what.add_argument(f"--{hint}", type=int, help=f"shape hint: {hint.replace('-', ' ')}")
    what.add_argument("--tie-embeddings", action="store_true", default=None, help="shape hint: tied embeddings")
    tune = parser.add_argument_group("fine-tuning (default: full training)")
    tune.add_argument("--lora-rank", type=int, help="LoRA rank R: adapters train, the base is frozen")
    tune.add_argument(
        "--lora-targets", default="q_proj,v_proj", help="comma-separated projections (default q_proj,v_proj)"
    )
    tune.add_argument(
        "--lora-base-bits", type=int, default=16, choices=(4, 16), help="4: the frozen base in NF4 (QLoRA)"
    )
    tune.add_argument("--trainable", type=float, metavar="FRACTION", help="share of the parameters that trains")
    parser.add_argument("--gpus", type=int, required=True, help="world size (devices in all)")
    parser.add_argument(
        "--strategy", help=f"comma-separated strategies to compare (default: {','.join(DEFAULT_STRATEGIES)})"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism: ranks each layer is split over")
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="with --tp: norms and residual split along the sequence"
    )
    parser.add_argument(
        "--loss-parallel", action="store_true", help="with --tp: logits and cross-entropy split over the vocabulary"
    )
    parser.add_argument(
        "--float8",
        action="store_true",
        help="the large Linears train in float8 (--train.float8; float8_rule.py's rule): their count, their casts",
    )
    parser.add_argument("--shard-size", type=int, help="hybrid_shard group size (default: up to 8, below --gpus)")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch per device (default 1)")
    parser.add_argument(
        "--ac",
        type=_checkpointing,
        default=False,
        metavar="none|all|k",
        help="activation checkpointing: none, all blocks, or every k-th block",
    )
    parser.add_argument(
        "--offload",
        nargs="?",
        const=1.0,
        default=None,
        type=float,
        metavar="FRACTION",
        help="CPU offload of parameters, gradients and optimizer state; with FRACTION (e.g. 0.5) of "
        "the units holding that share of the parameters (partial offload)",
    )
    parser.add_argument(
        "--offload-dir",
        metavar="DIR",
        help="the disk tier (with --offload): the offloaded optimizer state in files under DIR, an existing "
        "directory; the bill then shows its bytes on disk and the time reading and writing them takes per step",
    )
    parser.add_argument("--device-memory", help="e.g. 80GiB, 141GB (default: the local GPU's, else 80 GiB)")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16", help="param dtype (reduce in fp32)")
    parser.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, or state bytes per parameter")
    parser.add_argument("--keep-grads", action="store_true", help="gradients stay allocated between steps")
    parser.set_defaults(func=run)


def _default_device_memory() -> tuple[int, str]:
    try:
        return local_device_memory(accelerator="cuda", processes=1)
    except ValueError:  # no CUDA device here: the estimate is for one elsewhere
        return FALLBACK_DEVICE_MEMORY, "assumed: no local CUDA device; pass --device-memory"


def _model(args: argparse.Namespace):
    if args.model and args.params:
        raise ValueError(f"--model {args.model} and --params {args.params} both give the model; pass one of them")
    if not (args.model or args.params):
        raise ValueError(f"no model: pass --model (one of {', '.join(LLAMA_SIZES)}, or a config.json) or --params 7B")
    path = Path(args.model) if args.model else None
    if path is not None and path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"--model {args.model}: the folder holds no config.json; give a Hugging Face model folder")
    if path is not None and path.suffix == ".json":
        if not path.is_file():
            raise ValueError(f"--model {args.model}: no such file; give a Hugging Face config.json or a built-in size")
        return SimpleNamespace(**json.loads(path.read_text()))
    return args.model


def run(args: argparse.Namespace) -> int:
    try:
        if args.device_memory:
            memory, source = parse_bytes(args.device_memory, what="--device-memory"), "given"
        else:
            memory, source = _default_device_memory()
        hints = {
            "dim": args.dim,
            "layers": args.layers,
            "vocab": args.vocab,
            "ffn": args.ffn,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "tie_embeddings": args.tie_embeddings,
        }
        strategies = [s for s in args.strategy.split(",") if s] if args.strategy else None
        optimizer = float(args.optimizer) if args.optimizer.replace(".", "", 1).isdigit() else args.optimizer
        comparison = compare_strategies(
            _model(args),
            params=args.params,
            world_size=args.gpus,
            strategies=strategies,
            shard_size=args.shard_size,
            device_memory=memory,
            precision=args.precision,
            activation_checkpointing=args.ac,
            cpu_offload=_offload(args.offload, disk_dir=args.offload_dir),
            micro_batch=args.batch,
            seq_len=args.seq,
            optimizer=optimizer,
            keep_grads=args.keep_grads,
            lora_rank=args.lora_rank,
            lora_targets=args.lora_targets.split(","),
            trainable_fraction=args.trainable,
            base_bits=args.lora_base_bits,
            tp=args.tp,
            sequence_parallel=args.sequence_parallel,
            loss_parallel=args.loss_parallel,
            float8=args.float8,
            **hints,
        )
    except ValueError as exc:
        print(f"shardtrain estimate: error: {exc}", file=sys.stderr)
        return 2
    estimates = comparison.estimates
    print(estimates[0] if len(estimates) == 1 else comparison)
    print(model_states_arithmetic(estimates))
    print(f"device memory: {format_gib(memory)} GiB ({source})")
    return 0


def model_states_arithmetic(estimates: tuple[MemoryEstimate, ...]) -> str:
    """One line per estimate: (4 B fp32 parameter + 4 B fp32 gradient + o B optimizer state) x P / N, the
    model states each device holds (on the device, or in host memory when offloaded); a fine-tune's
    frozen parameters add only their stored bytes."""
    first = estimates[0].inputs
    per_param = 8 + first.optimizer_bytes
    model = first.model
    frozen, trainable = model.frozen_params, model.trainable_params
    frozen_size = first.frozen_param_bytes
    terms = f"x {'trainable params + ' if frozen else 'params'}"
    if frozen:
        terms += f"{frozen_size:g} B x frozen params,"
    lines = [
        f"model states per device = (4 B fp32 param + 4 B fp32 grad + {first.optimizer_bytes:g} B "
        f"{first.optimizer} state = {per_param:g} B/param) {terms} / ranks per shard:"
    ]
    width = max(len(e.inputs.label) for e in estimates)
    numbers = f"{per_param:g} B x {_count(trainable)}"
    if frozen:
        numbers = f"({numbers} + {frozen_size:g} B x {_count(frozen)})"
    total = per_param * trainable + frozen_size * frozen
    for estimate in estimates:
        inputs = estimate.inputs
        lines.append(
            f"  {inputs.label:<{width}}  {numbers} / {inputs.shard_size} = {format_gib(total / inputs.shard_size)} GiB"
        )
    return "\n".join(lines)


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _offload(fraction: float | None, *, disk_dir: str | None) -> CPUOffload | bool:
    """--offload [FRACTION]: nothing, everything, or the units holding FRACTION of the parameters; with
    --offload-dir, their optimizer state in the disk tier's files."""
    if fraction is None:
        if disk_dir is not None:
            raise ValueError(
                f"--offload-dir {disk_dir!r} without --offload: the disk tier holds offloaded optimizer state; "
                "add --offload"
            )
        return False
    return CPUOffload(fraction=fraction, disk_dir=disk_dir)
