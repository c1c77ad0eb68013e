"""Collective cost beside persistent GEMMs vs the NCCL CTA count of the communicator."""
import os, time, torch, torch.distributed as dist

SIZES = {"1.5B block": 30_500_000, "8B block": 109_000_000}
GEMMS, COLL = 6, 4

def wall_ms(fn, reps=8):
    for _ in range(2): fn()
    torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / reps

def group(min_ctas, max_ctas):
    if min_ctas is None:
        return dist.new_group(list(range(dist.get_world_size())))
    o = dist.ProcessGroupNCCL.Options()
    o.config.min_ctas = min_ctas
    o.config.max_ctas = max_ctas
    return dist.new_group(list(range(dist.get_world_size())), pg_options=o)

def main():
    rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    ws = dist.get_world_size()
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); b = torch.randn_like(a)
    side = torch.cuda.Stream(priority=-1)
    def gemms():
        for _ in range(GEMMS): a @ b
    configs = {"default": (None, None), "ctas 16": (16, 16), "ctas 32": (32, 32), "ctas 48": (48, 48), "ctas 64": (64, 64)}
    groups = {k: group(*v) for k, v in configs.items()}
    base = wall_ms(gemms)
    if rank == 0: print(f"{GEMMS} GEMMs alone {base:.2f} ms", flush=True)
    for label, n in SIZES.items():
        shard = torch.randn(n, device=dev).bfloat16()
        out = torch.empty(ws * n, device=dev, dtype=torch.bfloat16)
        full = torch.randn(ws * n, device=dev).bfloat16()
        a2a = torch.empty_like(full)
        for name, g in groups.items():
            for kind, coll in (("all-gather", lambda g=g: dist.all_gather_into_tensor(out, shard, group=g)),
                               ("all-to-all", lambda g=g: dist.all_to_all_single(a2a, full, group=g))):
                alone = wall_ms(lambda: [coll() for _ in range(COLL)]) / COLL
                def beside(coll=coll):
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(COLL): coll()
                    gemms()
                tog = wall_ms(beside)
                if rank == 0:
                    print(f"{label} {kind} {name}: alone {alone:.3f} ms; GEMMs+{COLL} beside {tog:.2f} (+{tog-base:.2f}, serial {COLL*alone:.2f})", flush=True)
    dist.barrier(); dist.destroy_process_group()

main()
