"""The disk tier on one GPU (issue 29, acceptance 2): the disk's raw bandwidth, then a built-in Llama
trained with CPU offload and its AdamW state in files (`st.CPUOffload(disk_dir=...)`), measuring the
read and write bandwidth the tier achieves during training, tokens/s, and the step time against the
bound that the state's bytes set (read it all and write it all once per step). Prints JSON lines.

    python benchmarks/disk_offload.py --dir /tmp/shardtrain-disk                  # 1 x H200, < 9 min
    python benchmarks/disk_offload.py --dir /tmp/shardtrain-disk --size 1.5b --layers 16
    python benchmarks/disk_offload.py --dir /tmp/shardtrain-disk --size 14b --layers 48 --fraction 0.5
    python benchmarks/disk_offload.py --smoke                                     # CPU, seconds

The default model is the 1.5b Llama deepened to 40 blocks (3.05B parameters: 24.4 GB of AdamW state
on disk, 12.2 GB each of fp32 masters and gradients in pinned host memory), batch 1 x 4096, every
block's activations checkpointed, bf16 compute. The raw probe writes then reads `--probe-gib` with
O_DIRECT, once from one thread (like `dd oflag=direct`) and once with the tier's thread pool.

`bound_s` is the step time if the disk did nothing but move the state: bytes read / raw read
bandwidth + bytes written / raw write bandwidth (one device serves both). `read_gbs` / `write_gbs`
are the bytes the tier moved over the seconds its requests were in flight (the union of their
intervals, per direction), `read_share` / `write_share` those against the raw figures (acceptance:
>= 0.8). Reads and writes share the device, so each direction's interval also holds the other's
transfers: `mixed_gbs` is both directions' bytes over the time either was in flight, `mixed_share`
that against the rate the bound assumes (how busy the tier keeps the disk).
"""

import argparse
import json
import os
import tempfile
import threading
import time

import torch
import torch.distributed as dist

import shardtrain as st
from shardtrain.core.shard_module import runtime_of
from shardtrain.models.llama import SHARD_UNITS, Block, Llama, llama_config
from shardtrain.offload import aio


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temporary one)")
    p.add_argument("--size", default="1.5b", help="a key of shardtrain.models.llama.LLAMA_SIZES")
    p.add_argument("--layers", type=int, default=40, help="blocks (overrides the size's; 40: 3.05B at 1.5b)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--fraction", type=float, default=1.0, help="share of the parameters offloaded (whole units)")
    p.add_argument("--pool-units", type=int, default=3, help="host buffers, in units of the largest unit's state")
    p.add_argument("--probe-gib", type=float, default=8.0)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (the first creates the state)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="a tiny run on the CPU: checks the script, measures nothing")
    return p.parse_args()


def raw_bandwidth(directory: str, nbytes: int, threads: int) -> dict:
    """GB/s of writing then reading `nbytes` with O_DIRECT (where allowed) from `threads` threads."""
    path = os.path.join(directory, f"raw-probe-{os.getpid()}-{threads}")
    file = aio.AsyncFile(path, direct=aio.direct_supported(directory), threads=threads)
    chunk = aio.aligned_empty(min(nbytes, 1 << 30))
    chunk.random_(0, 256)
    try:
        out = {}
        for name in ("write", "read"):
            start = time.perf_counter()
            for offset in range(0, nbytes, chunk.numel()):
                request = (file.write if name == "write" else file.read)(offset, chunk)
                request.wait()
                if name == "write" and offset + chunk.numel() >= nbytes:
                    os.fsync(file.fd)
            out[name] = nbytes / (time.perf_counter() - start) / 1e9
        return {"threads": threads, "direct": file.direct, "write_gbs": out["write"], "read_gbs": out["read"]}
    finally:
        file.close()
        os.unlink(path)


class IoMeter:
    """Bytes the disk tier reads and writes, and the seconds its requests were in flight (per direction)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()
        transfer = aio._transfer

        def metered(fd, piece, offset, write) -> None:
            start = time.perf_counter()
            transfer(fd, piece, offset, write)
            with self.lock:
                self.spans[write].append((start, time.perf_counter()))
                self.bytes[write] += len(piece)

        aio._transfer = metered

    def reset(self) -> None:
        with self.lock:
            self.spans = {False: [], True: []}
            self.bytes = {False: 0, True: 0}

    def busy_s(self, write: bool | None) -> float:
        """The union of the request intervals (of both directions for None)."""
        spans = self.spans[False] + self.spans[True] if write is None else self.spans[write]
        total, end = 0.0, float("-inf")
        for a, b in sorted(spans):
            if b > end:
                total += b - max(a, end)
                end = b
        return total


class PeakRss:
    def __init__(self) -> None:
        self.peak = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            with open("/proc/self/statm") as f:
                self.peak = max(self.peak, int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
            time.sleep(0.2)


def build(args: argparse.Namespace, directory: str, cuda: bool) -> tuple[torch.nn.Module, int]:
    """The sharded model with its state on disk, and the host pool's bytes."""
    cfg = llama_config(args.size, n_layers=args.layers, max_seq_len=max(args.seq, 128))
    with torch.device("meta"):
        model = Llama(cfg)
    # the largest unit (the embedding or the head; the root keeps only the final norm), its AdamW
    # moments in fp32 with each tensor's 64-byte alignment
    largest = max(sum(p.numel() for p in m.parameters()) for m in model.modules() if isinstance(m, tuple(SHARD_UNITS)))
    pool = args.pool_units * aio.align_up(2 * 4 * largest + 128 * 64)
    offload = st.CPUOffload(fraction=args.fraction, disk_dir=directory, disk_buffer_bytes=pool)
    if cuda:
        st.shard(
            model,
            strategy="full_shard",
            wrap=SHARD_UNITS,
            mixed_precision="bf16",
            activation_checkpointing={Block},
            cpu_offload=offload,
        )
    else:  # nothing is offloaded on a CPU device: host-step every unit and give it the disk tier
        from shardtrain.offload.attach import attach_disk_state
        from shardtrain.offload.host_step import overlap_host_steps

        st.shard(model, strategy="full_shard", wrap=SHARD_UNITS)
        runtime = runtime_of(model)
        attach_disk_state(overlap_host_steps(model, runtime, runtime.units), offload, rank=0)
    return model, pool


def main() -> None:
    args = parse_args()
    cuda = not args.smoke
    if args.smoke:
        args.size, args.layers, args.seq, args.probe_gib, args.warmup, args.steps = "2m", 4, 128, 1 / 16, 2, 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29529")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    directory = args.dir or tempfile.mkdtemp(prefix="shardtrain-disk-")
    os.makedirs(directory, exist_ok=True)
    probe_bytes = aio.align_up(int(args.probe_gib * 2**30))
    raw = [raw_bandwidth(directory, probe_bytes, threads) for threads in (1, 8)]
    for row in raw:
        print(json.dumps({"probe": directory, "gib": args.probe_gib, **row}), flush=True)
    raw_read, raw_write = max(r["read_gbs"] for r in raw), max(r["write_gbs"] for r in raw)

    meter, rss = IoMeter(), PeakRss()
    started = time.perf_counter()
    torch.manual_seed(0)
    model, pool = build(args, directory, cuda)
    store = runtime_of(model).step_hook.store  # the offload package's HostSteps
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    init_s = time.perf_counter() - started
    device = torch.device("cuda" if cuda else "cpu")
    vocab = llama_config(args.size).vocab_size
    gen = torch.Generator(device=device).manual_seed(1)
    marks = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            runtime_of(model)  # the warm-up's unit steps and their writes are done
            store.drain()
            meter.reset()
            marks.append(time.perf_counter())
        tokens = torch.randint(0, vocab, (1, args.seq + 1), device=device, generator=gen)
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    runtime_of(model)  # the last step's unit steps
    store.drain()
    if cuda:
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - marks[0]) / args.steps
    read_b, write_b = meter.bytes[False] / args.steps, meter.bytes[True] / args.steps
    read_gbs = meter.bytes[False] / max(meter.busy_s(False), 1e-9) / 1e9
    write_gbs = meter.bytes[True] / max(meter.busy_s(True), 1e-9) / 1e9
    bound_s = read_b / raw_read / 1e9 + write_b / raw_write / 1e9
    # both directions over the time either was in flight, against the raw mix (the bound's rate)
    mixed_gbs = (meter.bytes[False] + meter.bytes[True]) / max(meter.busy_s(None), 1e-9) / 1e9
    params = sum(p.numel() for p in model.parameters())
    print(
        json.dumps(
            {
                "size": args.size,
                "layers": args.layers,
                "params_b": params / 1e9,
                "fraction": args.fraction,
                "seq": args.seq,
                "state_on_disk_gb": store.file_bytes() / 1e9,
                "direct": store.direct,
                "pool_gb": pool / 1e9,
                "step_s": step_s,
                "tok_s": args.seq / step_s,
                "bound_s": bound_s,
                "step_over_bound": step_s / bound_s,
                "read_gb_per_step": read_b / 1e9,
                "write_gb_per_step": write_b / 1e9,
                "read_gbs": read_gbs,
                "write_gbs": write_gbs,
                "read_share": read_gbs / raw_read,
                "write_share": write_gbs / raw_write,
                "mixed_gbs": mixed_gbs,
                "mixed_share": mixed_gbs / ((read_b + write_b) / bound_s / 1e9),
                "raw_read_gbs": raw_read,
                "raw_write_gbs": raw_write,
                "bound_s_at_25gbs": (read_b + write_b) / 25e9,
                "host_rss_gib": rss.peak / 2**30,
                "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                "init_s": init_s,
                "loss": loss.item(),
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
