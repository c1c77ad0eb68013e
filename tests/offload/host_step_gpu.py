"""The overlapped host step on CUDA with the units offloaded (the real path: `st.shard` defers their
steps, during backward with CPUOffload(step_in_backward=True)), bitwise against
SHARDTRAIN_HOST_STEP=sequential. Run by test_host_step.py on a GPU machine:

    torchrun --nproc_per_node=1 tests/offload/host_step_gpu.py DIRECTORY
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.offload.host_step_ranks import (
    falls_back_once,
    in_backward_error,
    overlapped_equals_sequential,
)


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.use_deterministic_algorithms(True)  # both runs must add in the same order on the GPU
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    overlapped_equals_sequential(sys.argv[1], "adamw_fused", 10, True)
    for clip in (False, True):  # CPUOffload(step_in_backward=True): early, or falling back for clipping
        overlapped_equals_sequential(sys.argv[1], "adamw_fused", 10, True, True, clip)
    for case in ("clip", "skip", "lr"):  # torch_clip: the CPU tests (torch clipping host DTensors)
        assert "step_in_backward=False" in in_backward_error(case), case
    messages = falls_back_once("adagrad")
    assert len(messages) == 1 and "Adagrad" in messages[0], messages
    dist.barrier()
    if dist.get_rank() == 0:
        print("host step on CUDA: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
