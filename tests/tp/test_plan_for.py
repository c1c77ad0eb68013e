"""`st.tp.plan_for`: the plan the Engine and `shardtrain train --engine.tp N` give a model."""

import pytest
import torch
from torch.distributed.tensor.parallel import SequenceParallel

import shardtrain as st
from shardtrain.models.llama import Llama, llama_config


def test_plan_for_picks_the_built_in_llamas_or_the_hf_models_own():
    with torch.device("meta"):
        llama = Llama(llama_config("tiny"))
    assert st.tp.plan_for(llama).keys() == st.tp.llama_plan().keys()
    sequence = st.tp.plan_for(llama, sequence_parallel=True)
    assert isinstance(sequence["layers.*.attn_norm"], SequenceParallel)
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    assert st.tp.plan_for(hf).keys() == st.tp.hf_plan(
        hf
    ).keys() and "model.layers.*.self_attn.q_proj" in st.tp.plan_for(hf)
    with pytest.raises(ValueError, match="only the built-in Llama's plan has sequence parallelism"):
        st.tp.plan_for(hf, sequence_parallel=True)
    with pytest.raises(ValueError, match="only the built-in Llama's plan keeps the logits split"):
        st.tp.plan_for(hf, loss_parallel=True)
