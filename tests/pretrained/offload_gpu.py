"""st.load_pretrained into a model whose shards live in pinned host memory (cpu_offload), on one GPU.

python tests/pretrained/offload_gpu.py FOLDER     # prints "offload loads: ok" on success
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import shardtrain as st
from shardtrain.core.shard_module import runtime_of
from tests.pretrained import load_export_ranks


def main(folder: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29561"),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    device = torch.device("cuda", 0)
    reference = load_export_ranks.reference(folder).to(device)
    with torch.no_grad():
        expected = reference(load_export_ranks.INPUT.to(device)).logits
    for offload in (True, 0.5):
        model = load_export_ranks.meta_model(folder)
        st.shard(model, wrap=load_export_ranks.blocks(model), cpu_offload=offload, device=device)
        st.load_pretrained(model, folder)
        units = runtime_of(model).units
        hosts = [u.held(0).device.type == "cpu" and u.held(0).is_pinned() for u in units]
        assert any(hosts) and (all(hosts) if offload is True else not all(hosts)), hosts
        with torch.no_grad():
            diff = (model.eval()(load_export_ranks.INPUT.to(device)).logits - expected).abs().max().item()
        assert diff <= 1e-5, (offload, diff)
    print("offload loads: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
