"""Parity on CUDA with NCCL: `torchrun --nproc_per_node=N tests/gpu/nccl_parity.py` (exit 0 on success)."""

import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.core.parity import Case, run_case  # noqa: E402


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    # Note: CUDA's embedding and attention backward add in a racy order unless told otherwise; the
    # reference and the engine must add in the same order to agree at fp32 tolerance.
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    strategies = ["full_shard", "shard_grad_op", "no_shard"]
    cases = [(kind, Case(strategy=s, optim=o, accum=a, ac=ac))
             for kind in ["llama", "cnn", "frozen"] for s in strategies
             for o in ["sgd", "adamw_fused"] for a, ac in [("none", False), ("no_sync", True)]]
    cases += [("llama", Case(strategy=s, precision="bf16", accum="plain", clip=0.05)) for s in strategies]
    failed = 0
    for kind, case in cases:
        try:
            run_case(kind, case)
        except Exception:  # noqa: BLE001 - report every failing case, then fail
            failed += 1
            print(f"rank {dist.get_rank()} FAILED {kind} {case}:\n{traceback.format_exc()[-1500:]}", flush=True)
            dist.barrier()
    if dist.get_rank() == 0:
        print(f"nccl parity: {len(cases) - failed} cases passed, {failed} failed on {dist.get_world_size()} GPUs")
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
