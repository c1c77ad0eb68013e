"""Checkpoint save stall and host memory (BENCHMARKS.md, "Checkpoint save time").

Builds a built-in Llama on the meta device, shards it (full_shard, wrap={Block}, bf16 on CUDA),
trains 2 steps with AdamW, then times `st.save_checkpoint` in the sharded and the full format: wall
time per save between a device synchronisation + barrier before and a barrier after (the stall a
training loop sees). A sampling thread records this process's peak resident memory (RSS) during
each save. Prints one JSON line (rank 0) with every rank's numbers.

    torchrun --nproc_per_node=2 benchmarks/checkpoint_timing.py --size 1.5b --dir /scratch/ckpt
    torchrun --nproc_per_node=2 benchmarks/checkpoint_timing.py --size tiny          # CPU, Gloo
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

import shardtrain as st
from shardtrain.core.shard_module import runtime_of
from shardtrain.models.llama import Block, Llama, llama_config


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.5b", help="a key of shardtrain.models.llama.LLAMA_SIZES")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: 1024 on CUDA, 64 on CPU)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints (default: delete each after timing)")
    return parser.parse_args()


class PeakRSS:
    """Samples this process's resident memory every `interval` seconds while active."""

    def __init__(self, interval: float = 0.005) -> None:
        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.before = self.peak = 0

    def __enter__(self) -> PeakRSS:
        self.before = self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(self._interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def setup() -> torch.device:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def main() -> None:
    args = parse_args()
    device = setup()
    cuda = device.type == "cuda"
    seq = args.seq or (1024 if cuda else 64)
    cfg = llama_config(args.size)
    with torch.device("meta"):
        model = Llama(cfg)
    st.shard(model, strategy="full_shard", wrap={Block}, mixed_precision="bf16" if cuda else None, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, seq + 1), generator=generator).to(device)
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    root = Path(args.dir) if args.dir else Path(tempfile.gettempdir()) / "shardtrain-checkpoint-timing"
    mine = {"rank": dist.get_rank()}
    for fmt in ("sharded", "full"):
        path = root / f"{args.size}-{fmt}"
        sync()
        with PeakRSS() as rss:
            start = time.perf_counter()
            st.save_checkpoint(path, {"model": model, "optimizer": optimizer, "step": 2}, format=fmt)
            dist.barrier()
            seconds = time.perf_counter() - start
        size = sum(f.stat().st_size for f in path.iterdir()) if dist.get_rank() == 0 else None
        mine[fmt] = {
            "save_s": round(seconds, 3),
            "rss_before_gib": round(rss.before / 2**30, 3),
            "rss_peak_gib": round(rss.peak / 2**30, 3),
            "rss_growth_gib": round((rss.peak - rss.before) / 2**30, 3),
            "bytes": size,
        }
        dist.barrier()
        if dist.get_rank() == 0 and not args.keep:
            shutil.rmtree(path)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        largest_unit = max(u.layout.padded_numel for u in runtime_of(model).units)
        print(
            json.dumps(
                {
                    "size": args.size,
                    "params": cfg.num_params(),
                    "world_size": dist.get_world_size(),
                    "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "largest_unit_fp32_gib": round(largest_unit * 4 / 2**30, 3),
                    "dir": str(root),
                    "ranks": ranks,
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
