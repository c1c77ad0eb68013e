"""Host memory while loading a ~300 MB model at world 2: each rank's peak stays below its shard plus the
largest tensor plus 25%, i.e. no rank holds a whole file or the whole model.

The peak is measured from before the model was built, so it includes the shards st.shard allocated;
st.shard's own peak is bounded too (it initialises one unit whole before cutting its shard, so it
may hold the largest tensor twice: whole and the shard being cut from it)."""

import gc
import sys

import pytest
import torch

from tests.pretrained import load_export_ranks

pytest.importorskip("transformers")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak resident size from /proc")
def test_peak_host_memory_per_rank_while_loading(pools, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    model.save_pretrained(tmp_path)
    total = sum(p.numel() for p in model.parameters()) * 4
    del model
    gc.collect()
    assert 300e6 < total < 330e6
    for r in pools(2).run(load_export_ranks.peak_load_memory, str(tmp_path)):
        assert r["shard"] < 0.55 * total and r["largest"] == 32000 * 1024 * 4
        assert r["load_peak"] < 1.25 * (r["shard"] + r["largest"]), r
        assert r["shard_peak"] < 1.25 * (r["shard"] + 2 * r["largest"]), r
