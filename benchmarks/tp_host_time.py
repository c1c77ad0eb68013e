"""The host (Python and dispatch) time of the 2-D (FSDP x tensor parallel) path against the 1-D one.

tp_overhead.py measures the 2-D path's cost on a GPU, where it is host time the device may or may
not hide. This script measures that host time alone: one process, world 1, Gloo, one CPU thread, the
built-in Llama with 16 blocks (as the 1.5B, with its embedding and head units) but tiny dimensions,
so that the step's time is the Python and dispatch work it runs rather than arithmetic. The same
model is sharded twice, once on the 1-D mesh and once on a (1, 1) ("dp", "tp") mesh with
`st.tp.llama_plan()`; fused AdamW, `st.clip_grad_norm_`. Steps of the two alternate (so drift in the
machine's load hits both alike) and each phase is timed: forward, backward, clip, optimizer.step,
zero_grad. The table gives the median milliseconds per phase and per step over `--steps` steps.

    python benchmarks/tp_host_time.py                       # ~1 minute on one core
    python benchmarks/tp_host_time.py --profile 2-D         # plus cProfile of 2-D steps, by own time
    python benchmarks/tp_host_time.py --steps 20 --warmup 2 # quick check that it runs
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import init_device_mesh
from tp_overhead import init_single_process

import shardtrain as st
from shardtrain.models.llama import Llama, default_units, llama_config

# The thread's CPU time: the work this process does, not the time other processes on the machine take
# from it (the step runs in this thread; on the CPU, autograd runs backward in the calling thread).
clock = time.thread_time

PHASES = ("forward", "backward", "clip", "step", "zero_grad")
PATHS = ("1-D", "2-D")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200, help="timed steps of each path")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--profile", choices=PATHS, help="cProfile this path's steps after timing")
    parser.add_argument("--top", type=int, default=30, help="rows of the profile")
    return parser.parse_args()


def build(path: str, *, blocks: int) -> torch.nn.Module:
    # vocab x dim >= a block's parameters, so the embedding and the head are units of their own (as 1.5B)
    cfg = llama_config("1.5b", dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=1024, n_layers=blocks)
    torch.manual_seed(0)
    model = Llama(cfg)
    options = dict(wrap=default_units(cfg), device=torch.device("cpu"))
    if path == "2-D":
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        return st.shard(model, mesh=mesh, tp_plan=st.tp.llama_plan(), **options)
    return st.shard(model, **options)


def stepper(model: torch.nn.Module) -> Callable[[], tuple[float, ...]]:
    """One training step timed phase by phase (seconds each)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 17))

    def step() -> tuple[float, ...]:
        t0 = clock()
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        t1 = clock()
        loss.backward()
        t2 = clock()
        st.clip_grad_norm_(model, 1.0)
        t3 = clock()
        opt.step()
        t4 = clock()
        opt.zero_grad(set_to_none=True)
        t5 = clock()
        return (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)

    return step


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    init_single_process(torch.device("cpu"))
    steps = {path: stepper(build(path, blocks=args.blocks)) for path in PATHS}
    times: dict[str, list[tuple[float, ...]]] = {path: [] for path in PATHS}
    for i in range(args.warmup + args.steps):
        for path in PATHS if i % 2 else PATHS[::-1]:
            phases = steps[path]()
            if i >= args.warmup:
                times[path].append(phases)
    print(f"{'ms (median)':>12} " + " ".join(f"{p:>9}" for p in (*PHASES, "step total")))
    medians = {}
    for path in PATHS:
        per_phase = [statistics.median(t[k] for t in times[path]) * 1e3 for k in range(len(PHASES))]
        medians[path] = statistics.median(sum(t) for t in times[path]) * 1e3
        print(f"{path:>12} " + " ".join(f"{v:9.3f}" for v in (*per_phase, medians[path])))
    print(f"2-D - 1-D: {medians['2-D'] - medians['1-D']:+.3f} ms/step ({args.blocks} blocks, {args.steps} steps)")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            steps[args.profile]()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
