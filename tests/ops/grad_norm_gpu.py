"""The global gradient norm on CUDA (NCCL, one rank), with half the units offloaded (their gradients
in host memory) and without: as exact as torch's on the same gradients, and clipping scales exactly.
Run by tests/ops/test_grad_norm.py on a GPU machine: torchrun --nproc_per_node=1 grad_norm_gpu.py"""

import math

import torch.distributed as dist

import shardtrain as st
from tests.ops.grad_norm_ranks import norm_errors

SEEDS = [0, 1, 2]
BOUND = 2e-6

if __name__ == "__main__":
    dist.init_process_group("nccl")
    for offload in (False, st.CPUOffload(fraction=0.5)):
        for r in norm_errors("full_shard", SEEDS, device="cuda", cpu_offload=offload):
            print(f"offload {offload}: {r}")
            for norm_type in (2.0, 1.0):
                assert r[norm_type]["ours"] <= BOUND, (norm_type, r)
            assert r[math.inf]["ours"] == 0.0, r
            assert r["clip_scaled_exactly"], r
            assert abs(r["clipped_norm"] - 1) <= BOUND, r
    dist.destroy_process_group()
    print("grad norm on CUDA: ok")
