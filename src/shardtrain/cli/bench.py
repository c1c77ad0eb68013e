"""`shardtrain bench`: shardtrain against torch FSDP2, FSDP1 and DDP on the built-in Llama sizes.

Each engine runs in fresh torchrun processes, engines interleaved and repeated, with identical
model, data, seed, optimizer and precision. Prints tokens/s per GPU (median, min, max), MFU, peak
memory, the ratio to FSDP2, the loss after the last step, and with --profile / --ideal the step-time
breakdown and the ideal step. On a machine without GPUs it runs on the CPU with Gloo (small sizes).
"""

from __future__ import annotations

import argparse
import sys

EXAMPLE = (
    "example (CPU, a minute): shardtrain bench --sizes 2m --seq 128 --batch 2 --steps 3 --warmup 1 "
    "--device cpu --engines shardtrain,fsdp2,ddp"
)


def register(subparsers) -> None:
    from ..bench.registry import DEFAULT_ENGINES

    parser = subparsers.add_parser(
        "bench",
        help="benchmark this engine against DDP and torch FSDP",
        description=__doc__.split("\n\n")[1],
        epilog=EXAMPLE,
    )
    add = parser.add_argument
    add(
        "--sizes",
        help="comma-separated built-in Llama sizes, each optionally with settings of its own: "
        "NAME[:layers=N][:batch=N][:ac], e.g. 1.5b,8b:layers=8:batch=1:ac (default: 1.5b,8b on CUDA, 2m on the CPU)",
    )
    add(
        "--engines",
        default=",".join(DEFAULT_ENGINES),
        help="comma-separated: shardtrain, shardtrain-<strategy> (e.g. shardtrain-zero2), shardtrain-auto (the "
        "planner picks strategy, checkpointing and offload; --ac does not apply), fsdp2, fsdp2-noreshard, fsdp2-split "
        "(embedding and head as units of their own, as shardtrain wraps them), "
        "fsdp1, ddp (default: %(default)s)",
    )
    add("--batch", type=int, default=2, help="sequences per rank per step (default: %(default)s)")
    add("--seq", type=int, help="tokens per sequence (default: the size's max_seq_len, 4096 for 1.5b and 8b)")
    add("--ac", choices=("none", "all"), default="none", help="activation checkpointing of every Block")
    add(
        "--compile",
        action="store_true",
        help="compile every engine's blocks (Block.compile() per block, as torchtitan does) and the ideal step's",
    )
    add(
        "--float8",
        action="store_true",
        help="every engine's model with torchao's float8 Linears (the Linears shardtrain's float8 option converts), "
        "blocks compiled (implies --compile); the 'float8' extra",
    )
    add("--steps", type=int, default=10, help="timed steps per run (default: %(default)s)")
    add("--warmup", type=int, default=3, help="untimed steps before them (default: %(default)s)")
    add("--repeats", type=int, default=2, help="runs of every engine, interleaved (default: %(default)s)")
    add("--nproc", type=int, help="processes per run (default: every GPU; 2 on the CPU)")
    add("--device", choices=("cpu", "cuda"), help="default: cuda if available, else cpu")
    add(
        "--precision",
        choices=("bf16", "fp32"),
        help="bf16 compute with fp32 master weights and reduction, or fp32 throughout (default: bf16 on CUDA, "
        "fp32 on the CPU)",
    )
    add("--peak-tflops", type=float, help="per-GPU peak for MFU (default: 790, one H200's bf16 matmul rate, on CUDA)")
    add("--json", metavar="FILE", help="write the rows (and every run) as JSON, updated after each run")
    add("--profile", action="store_true", help="profile a few steps of each engine's first run: step-time breakdown")
    add("--profile-steps", type=int, default=2, help="steps under the profiler (default: %(default)s)")
    add("--trace-dir", metavar="DIR", help="keep the profiler traces (trace_<size>_<engine>.json.gz) here")
    add("--ideal", action="store_true", help="also time the ideal step (one GPU, resident params, no collectives)")
    add("--timeout", type=float, default=900.0, help="seconds before one run is stopped (default: %(default)s)")
    add(
        "--deadline",
        type=float,
        metavar="SECONDS",
        help="start no run after this many seconds; the runs left are reported as skipped",
    )
    add("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def options_from_args(args: argparse.Namespace):
    """Resolve the defaults that depend on the machine and validate everything before launching."""
    import torch

    from ..bench.metrics import H200_PEAK_TFLOPS
    from ..bench.runner import BenchOptions

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = args.device or ("cuda" if gpus else "cpu")
    if device == "cuda" and not gpus:
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu")
    nproc = args.nproc or (gpus if device == "cuda" else 2)
    if device == "cuda" and nproc > gpus:
        raise ValueError(f"--nproc {nproc} but only {gpus} GPU(s) are visible")
    split = lambda text: tuple(x.strip().lower() for x in text.split(",") if x.strip())  # noqa: E731
    return BenchOptions(
        sizes=split(args.sizes or ("1.5b,8b" if device == "cuda" else "2m")),
        engines=split(args.engines),
        batch=args.batch,
        seq=args.seq,
        ac=args.ac == "all",
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        nproc=nproc,
        device=device,
        precision=args.precision or ("bf16" if device == "cuda" else "fp32"),
        peak_tflops=args.peak_tflops or (H200_PEAK_TFLOPS if device == "cuda" else None),
        json_path=args.json,
        profile_steps=args.profile_steps if args.profile else 0,
        trace_dir=args.trace_dir,
        ideal=args.ideal,
        timeout_s=args.timeout,
        deadline_s=args.deadline,
        seed=args.seed,
        compile=args.compile or args.float8,
        float8=args.float8,
    )


def run(args: argparse.Namespace) -> int:
    from ..bench.report import render
    from ..bench.runner import SKIPPED, run_bench
    from ..bench.worker import OUT_OF_MEMORY

    try:
        options = options_from_args(args)
        options.spec(size=options.sizes[0], engine=options.engines[0])  # batch/seq/steps checked up front
    except (ValueError, IndexError) as exc:
        message = "--sizes and --engines must name at least one each" if isinstance(exc, IndexError) else exc
        print(f"shardtrain bench: error: {message}", file=sys.stderr)
        return 2
    rows = run_bench(options)
    print()
    print(render(rows), flush=True)
    return 0 if all(r.ok or r.status in (OUT_OF_MEMORY, SKIPPED) for r in rows) else 1
