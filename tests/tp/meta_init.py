"""Rank-side code of the meta-device tests with tensor parallelism: a model built on the meta device
and split by `tp_plan` gets the 1-D path's values, materialised one unit at a time."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardtrain as st
from shardtrain.core import DefaultInit
from shardtrain.models.llama import Block

from .parity_ranks import uneven_llama


def meta_init_matches_one_d(mesh_shape: tuple[int, int]) -> int:
    """Same seed, same units: the tensor-parallel model's `full_tensor()`s are the 1-D model's full
    tensors, bit for bit; and while a block is initialised, no other block holds whole weights."""
    torch.manual_seed(0)
    with torch.device("meta"):
        plain = uneven_llama(90)
    st.shard(plain, wrap={Block})
    expected = st.full_state_dict(plain, rank0_only=False)

    torch.manual_seed(0)
    with torch.device("meta"):
        model = uneven_llama(90)
    default = DefaultInit(model)
    blocks = {id(m): path for path, m in model.named_modules() if isinstance(m, Block)}
    owner = {id(m): blocks[id(b)] for b in model.modules() if id(b) in blocks for m in b.modules()}
    whole_elsewhere: list[tuple[str, list[str]]] = []

    def init(module: nn.Module) -> None:
        here = owner.get(id(module), "<root>")
        whole = sorted(
            {
                owner[id(m)]
                for m in model.modules()
                if id(m) in owner and owner[id(m)] != here
                for p in m.parameters(recurse=False)
                if not p.is_meta and not isinstance(p, DTensor)
            }
        )
        if whole:
            whole_elsewhere.append((here, whole))
        default(module)

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=st.tp.FLAT_NAMES)
    st.shard(model, mesh=mesh, tp_plan=st.tp.llama_plan(), wrap={Block}, param_init_fn=init)
    assert not whole_elsewhere, whole_elsewhere
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(p.full_tensor(), expected[name], rtol=0, atol=0, msg=name)
    # one step runs: the tp-split weights compute
    tokens = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    return 1
