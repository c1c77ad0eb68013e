"""The disk tier on CUDA with the units offloaded (the real path: `st.shard` attaches it), bitwise
against host-memory offload, with every unit and with half of them offloaded. Run by test_disk_state.py on a GPU machine:

    torchrun --nproc_per_node=1 tests/offload/disk_state_gpu.py DIRECTORY BUFFERED_DIRECTORY
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.offload.disk_state_ranks import disk_equals_memory


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.use_deterministic_algorithms(True)  # both runs must add in the same order on the GPU
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    disk_equals_memory(sys.argv[1], "direct")
    disk_equals_memory(sys.argv[2], "buffered")
    disk_equals_memory(os.path.join(sys.argv[1], "half"), "direct", fraction=0.5)  # partial offload
    dist.barrier()
    if dist.get_rank() == 0:
        print("disk tier on CUDA: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
