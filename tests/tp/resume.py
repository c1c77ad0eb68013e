"""Rank-side code of the tensor-parallel checkpoint tests: save at one (dp, tp), resume at another.

Every step trains on a global batch of 4 rows, cut among the dp ranks, so any (dp, tp) computes the
same update; a run resumed from the checkpoint at another mesh (or at (1, 1): each rank alone, the
one-dimensional engine) must continue exactly as the uninterrupted run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardtrain as st
from shardtrain.models.llama import Block, Llama, llama_config

ROWS = 4
ADAMW = dict(lr=1e-3, weight_decay=0.1, eps=1e-5)  # eps: tests/tp/parity_ranks.py says why


def _model(seed: int) -> Llama:
    """Vocabulary 1001 (uneven over 2 and 4 ranks), feed-forward 92 (tp 4 needs a multiple of 4)."""
    torch.manual_seed(seed)
    cfg = llama_config("tiny", vocab_size=1001, dim=48, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=92, max_seq_len=32)
    return Llama(cfg)


def _shard(model: Llama, mesh: tuple[int, int]) -> tuple[Llama, int, int]:
    """`model` sharded on `mesh` (dp, tp); (1, 1) shards each rank alone on the 1-D path. Returns
    (model, dp rank, dp size)."""
    if mesh == (1, 1):
        alone = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes every group
        return st.shard(model, wrap={Block}, process_group=alone[dist.get_rank()]), 0, 1
    device_mesh = init_device_mesh("cpu", mesh, mesh_dim_names=("dp", "tp"))
    st.shard(model, mesh=device_mesh, tp_plan=st.tp.llama_plan(sequence_parallel=True), wrap={Block})
    return model, device_mesh.get_local_rank("dp"), mesh[0]


def _train(model: Llama, opt: torch.optim.Optimizer, steps: range, dp_rank: int, dp: int) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 1001, (ROWS, 17), generator=g)
        mine = tokens[dp_rank * ROWS // dp : (dp_rank + 1) * ROWS // dp]
        model.loss(mine[:, :-1], mine[:, 1:]).backward()
        st.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _full(model: Llama) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach() for name, p in model.named_parameters()}


def save_then_continue(directory: str, mesh: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Train 3 steps at `mesh`, save (`directory`/sharded and `directory`/full), train 2 more; the
    parameters after them."""
    model, dp_rank, dp = _shard(_model(0), mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    _train(model, opt, range(3), dp_rank, dp)
    for fmt in ("sharded", "full"):
        st.save_checkpoint(f"{directory}/{fmt}", {"model": model, "optimizer": opt, "step": 3}, format=fmt)
    _train(model, opt, range(3, 5), dp_rank, dp)
    return _full(model)


def resume(directory: str, mesh: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A model of other weights at `mesh`, loaded from the checkpoint, trained the 2 steps after it."""
    model, dp_rank, dp = _shard(_model(1), mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    values = st.load_checkpoint(directory, {"model": model, "optimizer": opt})
    assert values == {"step": 3}, values
    _train(model, opt, range(3, 5), dp_rank, dp)
    return _full(model)
