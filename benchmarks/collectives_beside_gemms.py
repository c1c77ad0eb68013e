"""How much of a collective's time GEMMs lose when it runs beside them (2 GPUs, NVLink).

    torchrun --nproc_per_node 2 benchmarks/collectives_beside_gemms.py

For a 1.5B and an 8B Llama block's shard (bf16 elements per rank), it times four all-gathers alone,
six 8192³ bf16 GEMMs alone, and the GEMMs with the four all-gathers on a high-priority side stream
beside them (wall time around a whole-device synchronize, so every stream's work counts). It does
so for NCCL's ring all-gather, for the same all-gathers issued two at a time as one NCCL group
(one kernel for two units' gathers), and for torch's copy-engine all-gather on symmetric memory
(`torch.ops.symm_mem._low_contention_all_gather`), and checks that they deliver the same bytes.
Results of 2026-11-30 are in `results/2026-11-30-h200x2/collectives_beside_gemms.log` (BENCHMARKS.md).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

SHARD_ELEMENTS = {"1.5B block": 30_500_000, "8B block": 109_000_000}
GEMMS = 6
COLLECTIVES = 4


def wall_ms(fn, *, reps: int = 8) -> float:
    """Mean wall time of `fn` in ms, with the device and the ranks synchronised around the loop."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / reps


def main() -> None:
    import torch.distributed._symmetric_memory as symm_mem

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    group_name = dist.group.WORLD.group_name
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream(priority=-1)

    def gemms() -> None:
        for _ in range(GEMMS):
            a @ b

    for label, n in SHARD_ELEMENTS.items():
        shard = torch.randn(n, device=device).bfloat16()
        gathered = torch.empty(dist.get_world_size() * n, device=device, dtype=torch.bfloat16)
        symmetric = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
        symmetric.copy_(shard)
        symm_mem.rendezvous(symmetric, group=group_name)
        second = torch.empty_like(gathered)

        def grouped_pair() -> None:
            # Note: with a device, c10d puts every collective inside into one NCCL group (one launch).
            with dist.distributed_c10d._coalescing_manager(device=device):
                dist.all_gather_into_tensor(gathered, shard)
                dist.all_gather_into_tensor(second, shard)

        collectives = {
            "NCCL all-gather": lambda: dist.all_gather_into_tensor(gathered, shard),
            "NCCL all-gathers grouped in pairs (per gather)": grouped_pair,
            "copy-engine all-gather": lambda: torch.ops.symm_mem._low_contention_all_gather(symmetric, group_name),
        }
        alone_gemms = wall_ms(gemms)
        for name, collective in collectives.items():
            calls = COLLECTIVES // 2 if collective is grouped_pair else COLLECTIVES
            alone = wall_ms(lambda: [collective() for _ in range(calls)]) / COLLECTIVES

            def beside(collective=collective, calls=calls) -> None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(calls):
                        collective()
                gemms()

            together = wall_ms(beside)
            if rank == 0:
                print(
                    f"{label} ({n / 1e6:.1f}M) {name}: {alone:.3f} ms alone; {GEMMS} GEMMs {alone_gemms:.2f} ms, "
                    f"with {COLLECTIVES} beside {together:.2f} ms (+{together - alone_gemms:.2f} of "
                    f"{COLLECTIVES * alone:.2f} serial)",
                    flush=True,
                )
        copied = torch.ops.symm_mem._low_contention_all_gather(symmetric, group_name)
        second.zero_()
        grouped_pair()
        torch.cuda.synchronize()
        if rank == 0:
            same = torch.equal(copied.view(-1), gathered) and torch.equal(second, gathered)
            print(f"{label}: all three deliver the same bytes: {same}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
