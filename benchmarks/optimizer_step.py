"""The optimizer step over sharded parameters held as plain tensors or as DTensors (`Shard(0)`).

The optimizer sees one tensor per original parameter either way; the question is what DTensor's
dispatch costs a fused or foreach AdamW step, on the host and on the device. Parameters have the
shapes of a built-in Llama (this rank's rows at `--world`), gradients are set once, and each
variant steps `--steps` times after a warm-up.

    python benchmarks/optimizer_step.py --size 1.5b            # one process, a 1-rank mesh
    python benchmarks/optimizer_step.py --size 8b --layers 16   # 8B's shapes, half its layers
    python benchmarks/optimizer_step.py --size 1.5b --host --threads 1 8 16 --repeats 1
                                        # the host step of CPU offload: threads, pinned or pageable

Prints one row per (implementation, tensor kind): host milliseconds per `step()` call (the time
until it returns) and device milliseconds per step (CUDA events; the host time on the CPU). `--host`
steps CPU tensors (what CPU offload's host AdamW does) at each of `--threads` intra-op thread counts,
in pageable and, where CUDA is present, pinned memory.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from shardtrain.models.llama import Llama, llama_config


def local_shapes(size: str, layers: int | None, world: int) -> list[tuple[int, ...]]:
    """The shapes of this rank's rows of every parameter of the Llama `size`."""
    overrides = {"n_layers": layers} if layers else {}
    with torch.device("meta"):
        model = Llama(llama_config(size, **overrides))
    return [(math.ceil(p.shape[0] / world), *p.shape[1:]) for p in model.parameters()]


def make_params(shapes, *, device, mesh, world: int, as_dtensor: bool, pin: bool = False) -> list[torch.nn.Parameter]:
    params = []
    for shape in shapes:
        local = torch.randn(shape, device=device)
        if pin:
            local = local.pin_memory()
        if as_dtensor:
            global_shape = (shape[0] * world, *shape[1:])
            tensor = DTensor.from_local(
                local,
                mesh,
                [Shard(0)],
                run_check=False,
                shape=global_shape,
                stride=torch.empty(global_shape, device="meta").stride(),
            )
        else:
            tensor = local
        param = torch.nn.Parameter(tensor)
        param.grad = torch.randn_like(param)
        if pin:
            param.grad = param.grad.pin_memory()
        params.append(param)
    return params


def time_steps(optimizer: torch.optim.Optimizer, *, steps: int, device: torch.device) -> tuple[float, float]:
    for _ in range(3):
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    host = 0.0
    wall = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        optimizer.step()
        host += time.perf_counter() - t
    if device.type == "cuda":
        end.record()
        torch.cuda.synchronize()
        return host / steps * 1e3, start.elapsed_time(end) / steps
    return host / steps * 1e3, (time.perf_counter() - wall) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.5b")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (memory)")
    parser.add_argument("--world", type=int, default=1, help="rows per rank as at this world size")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--host", action="store_true", help="step CPU tensors (CPU offload's host step)")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="intra-op thread counts (--host)")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    cuda = torch.cuda.is_available()
    on_gpu = cuda and not args.host
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    shapes = local_shapes(args.size, args.layers, args.world)
    numel = sum(math.prod(s) for s in shapes)
    print(
        f"{args.size} ({len(shapes)} tensors, {numel / 1e9:.2f}B elements per rank at world {args.world}), "
        f"{torch.cuda.get_device_name() if on_gpu else 'cpu'}, torch {torch.__version__}"
    )
    print(f"{'implementation':<10} {'tensors':<8} {'threads':>7} {'memory':<8} {'host ms':>8} {'device ms':>10}")
    threads = args.threads if args.host and args.threads else [torch.get_num_threads()]
    memories = ["pageable", "pinned"] if args.host and cuda else ["device" if on_gpu else "pageable"]
    for impl in ("fused", "foreach"):
        for _ in range(args.repeats):
            for count, memory, kind in itertools.product(threads, memories, ("plain", "dtensor")):
                torch.set_num_threads(count)
                params = make_params(
                    shapes,
                    device=device,
                    mesh=mesh,
                    world=args.world,
                    as_dtensor=kind == "dtensor",
                    pin=memory == "pinned",
                )
                optimizer = torch.optim.AdamW(
                    params, lr=1e-4, fused=impl == "fused", foreach=None if impl == "fused" else True
                )
                host, dev = time_steps(optimizer, steps=args.steps, device=device)
                print(f"{impl:<10} {kind:<8} {count:>7} {memory:<8} {host:>8.2f} {dev:>10.2f}", flush=True)
                del optimizer, params
                if on_gpu:
                    torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
