"""Tokens/s, peak GPU memory, peak host memory and where the step's time goes, for one configuration
with or without CPU offload. Run under torchrun on GPUs; prints one JSON line from rank 0:

    torchrun --nproc_per_node=2 benchmarks/offload_step.py --size 8b --batch 1 --ac --offload
    torchrun --nproc_per_node=2 benchmarks/offload_step.py --size 18b --batch 1 --ac --offload 0.5
    torchrun --nproc_per_node=1 benchmarks/offload_step.py --size 1.5b --batch 2 --offload --split \
        --host-step sequential
    torchrun --nproc_per_node=1 benchmarks/offload_step.py --size 1.5b --batch 2 --offload --split \
        --host-step backward
    torchrun --nproc_per_node=1 benchmarks/offload_step.py --size 1.5b --batch 2 --offload --engine fsdp2

`benchmarks/offload_suite.py` runs the one-GPU comparison of issue 28 (one process per row).

`--host-step`: `sequential` (inside `step()`), `overlapped` (each unit during the next forward) or
`backward` (st.CPUOffload(step_in_backward=True): each unit during backward once its gradients
landed, else during the next forward; the loop has no clipping, so every unit can).

The breakdown (shardtrain with offload): `host_step_ms` the host optimizer step per step (inside
`step()` when sequential; summed over the worker's unit steps when overlapped), `in_backward_ms` the
part of it stepped during backward (unit steps that began before `loss.backward()` returned),
`waits_ms` the time the forward's hooks waited for a unit's deferred step (host step not hidden behind the GPU),
`fwd_ms` / `bwd_ms` / `step_call_ms` the host time until forward, backward and `step()` returned,
`h2d_gb` / `d2h_gb` the bytes crossing PCIe per step and `copy_ms` their time at the bandwidth
measured here with pinned buffers (`h2d_gbs`, `d2h_gbs`).
"""

import argparse
import json
import os
import threading
import time

import psutil
import torch
import torch.distributed as dist

import shardtrain as st
from shardtrain.core.shard_module import runtime_of
from shardtrain.models.llama import SHARD_UNITS, Block, Llama, llama_config
from shardtrain.offload.host_step import HostSteps
from shardtrain.offload.step_queue import worker_threads
from shardtrain.options import HOST_STEP_ENV


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="8b", help="a key of shardtrain.models.llama.LLAMA_SIZES")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--strategy", default="full_shard")
    p.add_argument("--ac", action="store_true", help="checkpoint every block's activations")
    p.add_argument(
        "--offload",
        nargs="?",
        const=1.0,
        default=None,
        type=float,
        metavar="FRACTION",
        help="CPU offload (shards and AdamW on the host), of every unit or of the units holding FRACTION "
        "of the parameters (st.CPUOffload(fraction=...))",
    )
    p.add_argument(
        "--keep-offloaded",
        action="store_true",
        help="the offloaded units keep their bf16 parameters from forward to backward "
        "(st.CPUOffload(reshard_after_forward=False)): copied to the device once a step",
    )
    p.add_argument("--split", action="store_true", help="the embedding and the head as units of their own")
    p.add_argument(
        "--host-step",
        choices=["overlapped", "sequential", "backward"],
        default="overlapped",
        help=f"sets {HOST_STEP_ENV}; backward: overlapped and CPUOffload(step_in_backward=True)",
    )
    p.add_argument(
        "--host-threads",
        type=int,
        default=None,
        help="the host step worker's threads (CPUOffload(threads=) one more: the worker takes one fewer)",
    )
    p.add_argument("--engine", choices=["shardtrain", "fsdp2"], default="shardtrain", help="fsdp2: CPUOffloadPolicy")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    return p.parse_args()


class PeakRss:
    """Samples this process's resident memory and the machine's used memory every 0.2 s."""

    def __init__(self) -> None:
        self.peak = self.machine_peak = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        proc = psutil.Process()
        while True:
            self.peak = max(self.peak, proc.memory_info().rss)
            self.machine_peak = max(self.machine_peak, psutil.virtual_memory().used)
            time.sleep(0.2)


class HostStepTimes:
    """Seconds spent in the worker's unit steps and in the hooks' waits for them, and unit steps done."""

    def __init__(self) -> None:
        self.step_s = self.wait_s = self.in_backward_s = 0.0
        self.unit_steps = 0
        self.backward_running = False  # set by the loop around loss.backward()
        step_unit, wait_for = HostSteps._step_unit, HostSteps.wait_for

        def timed_step(steps, task) -> None:
            during_backward = self.backward_running
            start = time.perf_counter()
            step_unit(steps, task)
            self.step_s += time.perf_counter() - start
            self.in_backward_s += (time.perf_counter() - start) if during_backward else 0.0
            self.unit_steps += 1

        def timed_wait(steps, units) -> None:
            start = time.perf_counter()
            wait_for(steps, units)
            self.wait_s += time.perf_counter() - start

        HostSteps._step_unit, HostSteps.wait_for = timed_step, timed_wait


def pinned_bandwidth(nbytes: int = 2**30) -> tuple[float, float]:
    """GB/s of one pinned host-to-device and one device-to-host copy of `nbytes`."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for dst, src in ((device, host), (host, device)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out.append(3 * nbytes / (time.perf_counter() - start) / 1e9)
    return out[0], out[1]


def build_shardtrain(args: argparse.Namespace) -> torch.nn.Module:
    os.environ[HOST_STEP_ENV] = "sequential" if args.host_step == "sequential" else "overlapped"
    offload = (
        False
        if args.offload is None
        else st.CPUOffload(
            fraction=args.offload,
            step_in_backward=args.host_step == "backward",
            reshard_after_forward=False if args.keep_offloaded else None,
            threads=None if args.host_threads is None else args.host_threads + 1,
        )
    )
    with torch.device("meta"):
        model = Llama(llama_config(args.size))
    return st.shard(
        model,
        strategy=args.strategy,
        wrap=SHARD_UNITS if args.split else {Block},
        mixed_precision="bf16",
        activation_checkpointing={Block} if args.ac else None,
        cpu_offload=offload,
    )


def build_fsdp2(args: argparse.Namespace) -> torch.nn.Module:
    """torch FSDP2 per Block and on the root, CPUOffloadPolicy when offloading, as torchtitan sets it up."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from shardtrain.bench.engines import checkpoint_blocks
    from shardtrain.bench.same_weights import build_meta_model

    named = build_meta_model(llama_config(args.size))
    model = named.model
    if args.ac:
        checkpoint_blocks(model)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    offload = CPUOffloadPolicy() if args.offload is not None else OffloadPolicy()
    options = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for block in model.layers:
        fully_shard(block, offload_policy=offload, **options)
    fully_shard(model, offload_policy=offload, **options)
    model.to_empty(device="cpu" if args.offload is not None else "cuda")
    named.init_all_(seed=0, device=torch.device("cuda"))
    for name, buffer in model._buffers.items():  # the rotary tables live on the GPU
        model._buffers[name] = buffer.cuda()
    return model


def copy_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes copied host-to-device and device-to-host per step by shardtrain's offloaded units."""
    h2d = d2h = 0
    for unit in runtime_of(model).units:
        if not unit.behaviour.offload:
            continue
        gathers = 2 if unit.behaviour.reshard_after_forward else 1  # forward, and again in backward
        for buf in unit.buffers:
            h2d += gathers * buf.shard.numel() * buf.shard.element_size()
            if buf.group.trainable:
                d2h += buf.group.grad_numel * buf.shard.element_size()
    return h2d, d2h


def main() -> None:
    args = parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    cfg = llama_config(args.size)
    rss = PeakRss()
    h2d_gbs, d2h_gbs = pinned_bandwidth()
    times = HostStepTimes()
    started = time.perf_counter()
    torch.manual_seed(0)
    model = build_shardtrain(args) if args.engine == "shardtrain" else build_fsdp2(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # on the host when offloaded
    init_s = time.perf_counter() - started
    gen = torch.Generator(device="cuda").manual_seed(1)
    phases, step_calls = [], []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device="cuda", generator=gen)
        if step == args.warmup:
            torch.cuda.reset_peak_memory_stats()
            times.step_s = times.wait_s = times.in_backward_s = 0.0
            times.unit_steps = 0
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        forward = time.perf_counter()
        times.backward_running = True
        loss.backward()
        times.backward_running = False
        backward = time.perf_counter()
        opt.step()
        step_calls.append(time.perf_counter() - backward)
        opt.zero_grad()
        torch.cuda.synchronize()
        phases.append((time.perf_counter() - start, forward - start, backward - forward))
    timed = sorted(phases[args.warmup :])
    step_s, fwd_s, bwd_s = timed[len(timed) // 2]
    sequential_step_s = sorted(step_calls[args.warmup :])[args.steps // 2]
    waits_s = times.wait_s / args.steps
    if args.engine == "shardtrain":
        runtime = runtime_of(model)  # completes the last step's deferred host steps
        units = len(runtime.step_hook.units) if isinstance(runtime.step_hook, HostSteps) else 0
        per_step = times.unit_steps / units if times.unit_steps else 0
        host_step_s = times.step_s / per_step if per_step else sequential_step_s
        in_backward_s = times.in_backward_s / per_step if per_step else 0.0
        h2d, d2h = copy_bytes(model) if args.offload is not None else (0, 0)
        offloaded = [u for u in runtime.units if u.behaviour.offload]
    else:
        host_step_s, in_backward_s, h2d, d2h, offloaded = sequential_step_s, 0.0, 0, 0, []
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "size": args.size,
                    "engine": args.engine,
                    "strategy": args.strategy,
                    "ac": args.ac,
                    "offload": args.offload,
                    "split": args.split,
                    "keep_offloaded": args.keep_offloaded,
                    "host_step": args.host_step if args.offload is not None else None,
                    "batch": args.batch,
                    "tok_s_gpu": args.batch * args.seq / step_s,
                    "step_ms": step_s * 1000,
                    "fwd_ms": fwd_s * 1000,
                    "bwd_ms": bwd_s * 1000,
                    "step_call_ms": sequential_step_s * 1000,
                    "host_step_ms": host_step_s * 1000,
                    "in_backward_ms": in_backward_s * 1000,
                    "waits_ms": waits_s * 1000,
                    "offloaded_units": len(offloaded),
                    "offloaded_params": sum(p.numel() for u in offloaded for p in u.params),
                    "h2d_gb": h2d / 1e9,
                    "d2h_gb": d2h / 1e9,
                    "copy_ms": (h2d / h2d_gbs + d2h / d2h_gbs) / 1e6,
                    "h2d_gbs": h2d_gbs,
                    "d2h_gbs": d2h_gbs,
                    "threads": torch.get_num_threads(),
                    "host_step_threads": worker_threads(),
                    "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "host_rss_gib_rank0": rss.peak / 2**30,
                    "host_used_gib_machine": rss.machine_peak / 2**30,
                    "host_total_gib": psutil.virtual_memory().total / 2**30,
                    "init_s": init_s,
                    "losses_ok": bool(torch.isfinite(loss)),
                    "loss": loss.item(),
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
