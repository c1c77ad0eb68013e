"""Tokens/s, peak GPU memory and peak host memory of one shardtrain configuration, with or without
CPU offload. Run under torchrun on GPUs; prints one JSON line from rank 0:

    torchrun --nproc_per_node=2 benchmarks/offload_step.py --size 8b --batch 1 --ac --offload
    torchrun --nproc_per_node=2 benchmarks/offload_step.py --size 18b --batch 1 --ac --offload 0.5
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
from shardtrain.models.llama import Block, Llama, llama_config


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


def main() -> None:
    args = parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    cfg = llama_config(args.size)
    rss = PeakRss()
    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(cfg)
    st.shard(
        model,
        strategy=args.strategy,
        wrap={Block},
        mixed_precision="bf16",
        activation_checkpointing={Block} if args.ac else None,
        cpu_offload=False if args.offload is None else st.CPUOffload(fraction=args.offload),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # on the host when offloaded
    init_s = time.perf_counter() - started
    gen = torch.Generator(device="cuda").manual_seed(1)
    times = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device="cuda", generator=gen)
        if step == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    timed = sorted(times[args.warmup :])
    step_s = timed[len(timed) // 2]
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "size": args.size,
                    "strategy": args.strategy,
                    "ac": args.ac,
                    "offload": args.offload,
                    "tok_s_gpu": args.batch * args.seq / step_s,
                    "step_ms": step_s * 1000,
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
