"""The tensor-parallel pieces that need no process group: placements, boxes, plans and their errors."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import _StridedShard

import shardtrain as st
from shardtrain.tp.boxes import Box, held_box, stores
from shardtrain.tp.placements import mesh_placements
from shardtrain.tp.plans import resolve_plan, translate_hf_plan


def test_placements_are_fsdp2s():
    assert mesh_placements(Shard(0), tp_size=2, hybrid=False, cut=True) == (_StridedShard(0, split_factor=2), Shard(0))
    assert mesh_placements(Shard(1), tp_size=2, hybrid=False, cut=True) == (Shard(0), Shard(1))
    assert mesh_placements(Replicate(), tp_size=2, hybrid=False, cut=True) == (Shard(0), Replicate())
    assert mesh_placements(Shard(0), tp_size=1, hybrid=False, cut=True) == (Shard(0), Shard(0))
    assert mesh_placements(Replicate(), tp_size=2, hybrid=True, cut=False) == (Replicate(), Replicate(), Replicate())
    with pytest.raises(ValueError, match=r"placed _S\(0, 2\) on .tp.: use Shard"):
        mesh_placements(_StridedShard(0, split_factor=2), tp_size=2, hybrid=False, cut=True)


def test_boxes_tile_the_global_tensor_once():
    """Every element of a (10, 7) tensor is stored by exactly one rank, at any (dp, tp) and split."""
    shape = (10, 7)
    for split in (None, "rows", "cols"):
        for dp, tp in ((1, 1), (2, 2), (3, 2), (4, 1), (1, 4), (4, 3)):
            count = [[0] * 7 for _ in range(10)]
            for d in range(dp):
                for t in range(tp):
                    if not stores(shape, split=split, dp_rank=d, tp_rank=t):
                        continue
                    box = held_box(shape, split=split, dp_rank=d, dp_world=dp, tp_rank=t, tp_world=tp)
                    cols = box.cols or (0, 7)
                    for r in range(*box.rows):
                        for c in range(*cols):
                            count[r][c] += 1
            assert all(n == 1 for row in count for n in row), (split, dp, tp)
    # rows split over tp first, then over dp inside each tp block: rank (1, 0) holds rows 3..5 of 0..5
    assert held_box(shape, split="rows", dp_rank=1, dp_world=2, tp_rank=0, tp_world=2) == Box(rows=(3, 5))
    assert Box(rows=(0, 4), cols=(2, 5)).intersect(Box(rows=(3, 8)), shape) == Box(rows=(3, 4), cols=(2, 5))
    whole = torch.arange(70).view(shape)
    assert torch.equal(Box(rows=(3, 5), cols=(2, 4)).cut(whole), whole[3:5, 2:4])
    assert torch.equal(Box(rows=(3, 5)).cut(whole), whole[3:5])


def test_llama_plan():
    plain, sp = st.tp.llama_plan(), st.tp.llama_plan(sequence_parallel=True, loss_parallel=True)
    assert isinstance(plain["layers.*.attn.wq"], ColwiseParallel)
    assert isinstance(plain["layers.*.ffn.w2"], RowwiseParallel)
    assert "layers.*.attn_norm" not in plain and isinstance(sp["layers.*.attn_norm"], SequenceParallel)
    assert sp["head"].output_layouts == (Shard(-1),) and not sp["head"].use_local_output
    with pytest.raises(TypeError, match="sequence_parallel='yes'"):
        st.tp.llama_plan(sequence_parallel="yes")


def test_transformers_plan_strings():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    plan = st.tp.hf_plan(LlamaForCausalLM(config))
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert plan["lm_head"].output_layouts == (Replicate(),)
    assert isinstance(resolve_plan({"a": "colwise", "b": RowwiseParallel()})["a"], ColwiseParallel)
    with pytest.raises(ValueError, match="'packed_colwise' is not supported"):
        translate_hf_plan({"layers.*.mlp.gate_up_proj": "packed_colwise"})
    with pytest.raises(TypeError, match="tp_plan"):
        resolve_plan(["colwise"])


def test_plan_from_the_config_alone_takes_the_base_model_prefix():
    from types import SimpleNamespace

    from torch import nn

    class WithHead(nn.Module):
        base_model_prefix = "model"

        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.config = SimpleNamespace(base_model_tp_plan={"layers.*.mlp.up_proj": "colwise"})

    plan = st.tp.hf_plan(WithHead())
    assert list(plan) == ["model.layers.*.mlp.up_proj"] and isinstance(
        plan["model.layers.*.mlp.up_proj"], ColwiseParallel
    )
    with pytest.raises(ValueError, match="declares no base_model_tp_plan"):
        st.tp.hf_plan(nn.Linear(2, 2))
