"""The host's floor for one offloaded step: the host AdamW and the step's PCIe copies, alone and together.

An offloaded step cannot be shorter than the host work it needs: the fused AdamW over every offloaded
parameter, and the copies of the parameters to the device and of the gradients back. The two share
host memory (AdamW reads and writes 28 bytes per parameter; each copied byte is read or written by
the DMA engines), so run side by side they take longer than the slower of the two alone. This
script measures, on the offload benchmark's shapes (the built-in 1.5B: 1,532M parameters in its
units' sizes), with pinned host memory and the host step's thread count:

    adamw      torch's fused AdamW over the fp32 shards, alone
    copies     the step's copies alone: the parameters host->device (`--h2d-passes` times: 2 when
               forward and backward each fetch them, 1 under shard_grad_op) and the gradients back
    together   both at once (the copies in a second thread): the floor of the host side of a step

    python benchmarks/host_floor.py                 # one H200 host, about a minute
    python benchmarks/host_floor.py --smoke         # CPU only, small tensors: checks the script

Prints one JSON line; `together_s` is the floor that offload_suite.py's step times compare against.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time

import torch

from shardtrain.models.llama import Block, Llama, llama_config


def unit_sizes(size: str) -> list[int]:
    """Parameter counts of the built-in Llama's units (each block; the rest of the model as one)."""
    with torch.device("meta"):
        model = Llama(llama_config(size))
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.modules() if isinstance(block, Block)]
    return blocks + [sum(p.numel() for p in model.parameters()) - sum(blocks)]


def timed(fn, repeats: int) -> float:
    """The best of `repeats` runs of `fn`, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.5b")
    parser.add_argument("--h2d-passes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available() and not args.smoke
    sizes = [1 << 16] * 4 if args.smoke else unit_sizes(args.size)
    pin = dict(pin_memory=cuda)
    params = [torch.randn(n, **pin) for n in sizes]
    for p in params:
        p.grad = torch.empty(p.numel(), **pin).normal_(std=1e-3)  # pinned, as the offloaded gradients
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    opt.step()  # creates the state

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    largest = max(sizes)
    on_device = [torch.empty(largest, device=device) for _ in range(2)]
    stream = torch.cuda.Stream() if cuda else None

    def copies() -> None:
        """The step's copies, unit by unit: parameters up `h2d_passes` times, gradients down once."""
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for i, p in enumerate(params):
                for _ in range(args.h2d_passes):
                    on_device[i % 2][: p.numel()].copy_(p, non_blocking=True)
                p.grad.copy_(on_device[i % 2][: p.numel()], non_blocking=True)
            if cuda:
                stream.synchronize()

    def together() -> None:
        side = threading.Thread(target=copies)
        side.start()
        opt.step()
        side.join()

    adamw_s = timed(opt.step, args.repeats)
    copies_s = timed(copies, args.repeats)
    together_s = timed(together, args.repeats)
    numel = sum(sizes)
    moved = numel * 4 * (args.h2d_passes + 1)
    print(
        json.dumps(
            {
                "size": "smoke" if args.smoke else args.size,
                "params_m": numel / 1e6,
                "threads": args.threads,
                "h2d_passes": args.h2d_passes,
                "adamw_s": adamw_s,
                "adamw_gbs": numel * 28 / adamw_s / 1e9,  # bytes AdamW reads and writes
                "copies_s": copies_s,
                "copies_gbs": moved / copies_s / 1e9,
                "together_s": together_s,
                "max_alone_s": max(adamw_s, copies_s),
                "together_over_max_alone": together_s / max(adamw_s, copies_s),
            }
        )
    )


if __name__ == "__main__":
    main()
