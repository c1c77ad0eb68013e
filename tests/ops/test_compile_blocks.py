"""`compile_blocks` compiles the repeated blocks of a sharded model (not the embedding, head or root),
and the Engine's compile=True does it after sharding."""

import torch

import shardtrain as st
from shardtrain.models.llama import SHARD_UNITS
from shardtrain.ops.compile import compile_blocks
from tests.models import split_llama


def _compiled_blocks() -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = st.shard(split_llama(), wrap=SHARD_UNITS)
    names = compile_blocks(model, backend="aot_eager")
    tokens = torch.randint(0, 256, (2, 9))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    compiled = [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    return {"names": names, "compiled": compiled}


def test_compile_blocks_picks_the_repeated_blocks(pools):
    for r in pools(2).run(_compiled_blocks):
        assert r["names"] == ["layers.0", "layers.1"] and r["compiled"] == ["layers.0", "layers.1"], r
