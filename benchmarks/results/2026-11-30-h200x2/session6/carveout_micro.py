"""Is the per-collective GEMM loss a persistent-GEMM effect? Try cuBLAS SM carve-out and stream priority.

torchrun --nproc_per_node 2 .scratch/carve.py
"""
import json
import os
import time

import torch
import torch.distributed as dist

from shardtrain.models.llama import Block, llama_config, rotary_tables


def wall_ms(fn, reps=8):
    for _ in range(2):
        fn()
    torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / reps


def main():
    import torch.distributed._symmetric_memory as symm_mem
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    gname = dist.group.WORLD.group_name
    out = lambda *a: print(*a, flush=True) if rank == 0 else None
    out("sms", torch.cuda.get_device_properties(dev).multi_processor_count, "NCCL env",
        {k: v for k, v in os.environ.items() if k.startswith("NCCL_")})

    results = {}
    for size, batch in (("1.5b", 2), ("8b", 1)):
        cfg = llama_config(size)
        block = Block(cfg).to(dev, torch.bfloat16)
        cos, sin = rotary_tables(cfg, dev)
        x = torch.randn(batch, 4096, cfg.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
        n = sum(p.numel() for p in block.parameters()) // 2
        shard = torch.randn(n, device=dev).bfloat16()
        gathered = torch.empty(2 * n, device=dev, dtype=torch.bfloat16)
        sym = symm_mem.empty(n, dtype=torch.bfloat16, device=dev)
        sym.copy_(shard)
        symm_mem.rendezvous(sym, group=gname)
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

        def step():
            block(x, cos, sin).sum().backward()

        def gemms():
            for _ in range(4):
                a @ a

        kinds = {"nccl": lambda: dist.all_gather_into_tensor(gathered, shard),
                 "ce": lambda: torch.ops.symm_mem._low_contention_all_gather(sym, gname)}
        for cname, compute in (("block", step), ("gemm8k", gemms)):
            for carve in (0, 8, 16, 24, 32):
                torch._C._set_sm_carveout_experimental(carve or None)
                alone = wall_ms(compute)
                row = [f"{size} {cname} carve={carve:2d}: alone {alone:7.2f}"]
                for kname, coll in kinds.items():
                    if kname == "ce" and carve not in (0, 8):
                        continue
                    for prio in (-1, 0):
                        side = torch.cuda.Stream(priority=prio)
                        c_alone = wall_ms(lambda: [coll() for _ in range(2)]) / 2

                        def both():
                            side.wait_stream(torch.cuda.current_stream())
                            with torch.cuda.stream(side):
                                coll(); coll()
                            compute()
                            torch.cuda.current_stream().wait_stream(side)
                        tog = wall_ms(both)
                        row.append(f"{kname}/p{prio} +{tog - alone:5.2f} of {2 * c_alone:4.2f}")
                        results[f"{size}|{cname}|{carve}|{kname}|{prio}"] = (alone, tog, c_alone)
                out(" | ".join(row))
        torch._C._set_sm_carveout_experimental(None)
        # kernel names and grids of the compute
        if size == "1.5b":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step(); gemms(); torch.cuda.synchronize()
            if rank == 0:
                prof.export_chrome_trace("/tmp/carve_trace.json")
                ev = json.load(open("/tmp/carve_trace.json"))["traceEvents"]
                seen = {}
                for e in ev:
                    if e.get("cat") == "kernel":
                        key = e["name"][:110]
                        g = e.get("args", {}).get("grid")
                        seen.setdefault(key, [0, 0.0, g])
                        seen[key][0] += 1
                        seen[key][1] += e["dur"]
                for k, (c, d, g) in sorted(seen.items(), key=lambda kv: -kv[1][1])[:14]:
                    out(f"  kernel x{c} {d / 1e3:7.2f} ms grid={g} {k}")
        del block, x
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
