"""One "node" of a 2-node hybrid_shard run on loopback (started by test_multinode.py via torchrun)."""

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.core.parity import Case, run_cases

if __name__ == "__main__":
    dist.init_process_group("gloo")
    # No mesh given: hybrid_shard shards inside each node (LOCAL_WORLD_SIZE ranks) and replicates across.
    done = run_cases(
        "llama",
        [
            Case(strategy="hybrid_shard", optim="adamw", accum="no_sync"),
            Case(strategy="hybrid_shard_zero2", optim="sgd"),
        ],
    )
    print(f"rank {dist.get_rank()}: {done} hybrid cases passed", flush=True)
    dist.destroy_process_group()
