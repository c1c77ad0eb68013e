"""The cost of the 2-D (FSDP x tensor parallel) code path against the 1-D one, on one device (issue 34).

One process, world 1: the same built-in Llama sharded twice, once as always (`st.shard(model, ...)`,
a 1-D mesh) and once through the tensor-parallel path on a (1, 1) mesh named ("dp", "tp") with
`tp_plan=st.tp.llama_plan()` (tp 1 splits nothing: the optimizer's DTensors live on the 2-D mesh,
the views and the norm go through tp/tensor_parallel.py). bf16 compute, fp32 master weights, fused
AdamW with clipping; 1.5B at batch 2 x 4096, 8B at batch 1 x 4096 with every block checkpointed.
Each configuration is built, warmed up, then timed over two windows of steps (device synchronised
at both ends); the table gives tokens/s (the better window), the peak memory, and 2-D / 1-D. With
`--rounds N` each size is measured N times, the two paths' order alternating from round to round
(so neither always runs first), and the mean and spread of the N ratios close the table.
The two paths' host time alone, phase by phase, on one CPU thread: benchmarks/tp_host_time.py.

    python benchmarks/tp_overhead.py                 # one H200: 1.5B and 8B, both paths (~5 minutes)
    python benchmarks/tp_overhead.py --sizes 1.5b    # one size
    python benchmarks/tp_overhead.py --rounds 5      # five alternating rounds per size
    python benchmarks/tp_overhead.py --smoke         # CPU, Gloo, a tiny model: checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardtrain as st
from shardtrain.models.llama import Block, Llama, default_units, llama_config

# size -> (batch, checkpoint every block)
SETUPS = {"1.5b": (2, False), "8b": (1, True)}


@dataclass(frozen=True, kw_only=True)
class Result:
    size: str
    path: str
    tokens_per_s: float
    peak_gib: float
    loss: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps per timed window (two windows)")
    parser.add_argument("--rounds", type=int, default=1, help="measurements of both paths per size, order alternating")
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny model, 2 steps: the script runs")
    return parser.parse_args()


def init_single_process(device: torch.device) -> None:
    """A process group of one (this script runs without torchrun)."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def build(size: str, path: str, *, device: torch.device, checkpointed: bool) -> torch.nn.Module:
    cfg = llama_config(size)
    with torch.device("meta"):
        model = Llama(cfg)
    options = dict(
        wrap=default_units(cfg),
        mixed_precision="bf16",
        activation_checkpointing={Block} if checkpointed else None,
        device=device,
    )
    if path == "2-D":
        mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp", "tp"))
        return st.shard(model, mesh=mesh, tp_plan=st.tp.llama_plan(), **options)
    return st.shard(model, **options)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(size: str, path: str, args: argparse.Namespace, device: torch.device) -> Result:
    batch, checkpointed = SETUPS.get(size, (1, False))
    torch.manual_seed(0)
    model = build(size, path, device=device, checkpointed=checkpointed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    vocab = model.cfg.vocab_size
    tokens = torch.randint(0, vocab, (batch, args.seq + 1), device=device)

    def step() -> torch.Tensor:
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        st.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(args.warmup):
        loss = step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    windows = []
    for _ in range(2):
        sync(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        sync(device)
        windows.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return Result(
        size=size,
        path=path,
        tokens_per_s=batch * args.seq * args.steps / min(windows),
        peak_gib=peak,
        loss=float(loss),
    )


def measure_and_free(size: str, path: str, args: argparse.Namespace, device: torch.device) -> Result:
    """`measure`, then the model and its optimizer state freed before the next configuration is built."""
    result = measure(size, path, args, device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    args = parse_args()
    device = torch.device("cpu") if args.smoke or not torch.cuda.is_available() else torch.device("cuda", 0)
    if args.smoke:
        args.sizes, args.seq, args.warmup, args.steps = ["tiny"], 64, 1, 2
    init_single_process(device)
    started = time.perf_counter()
    print(f"{'size':>5} {'path':>4} {'tokens/s':>10} {'peak GiB':>9} {'loss':>8} {'2-D / 1-D':>10}")
    for size in args.sizes:
        ratios = []
        for round_ in range(args.rounds):
            order = ("1-D", "2-D") if round_ % 2 == 0 else ("2-D", "1-D")
            by_path = {path: measure_and_free(size, path, args, device) for path in order}
            one, two = by_path["1-D"], by_path["2-D"]
            ratios.append(two.tokens_per_s / one.tokens_per_s)
            for r in (one, two):
                ratio = f"{ratios[-1]:10.4f}" if r is two else ""
                print(
                    f"{r.size:>5} {r.path:>4} {r.tokens_per_s:10.0f} {r.peak_gib:9.2f} {r.loss:8.4f} {ratio}",
                    flush=True,
                )
        if args.rounds > 1:
            mean = sum(ratios) / len(ratios)
            print(
                f"{size:>5} 2-D / 1-D over {len(ratios)} rounds: mean {mean:.4f}, min {min(ratios):.4f}, max {max(ratios):.4f}"
            )
    print(f"total {time.perf_counter() - started:.0f} s on {device}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
