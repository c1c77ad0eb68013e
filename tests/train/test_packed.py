"""train/packed.py: transformers' LlamaForCausalLM (sdpa, eager, flex_attention; under peft and
st.shard too) on packed rows gives every document the logits and loss of the document run alone,
and the configurations that would leak across documents are refused in one line."""

import pytest
import torch
from torch import nn

from shardtrain.train.packed import (
    check_packing_static,
    check_packing_supported,
    forward_logits,
    use_block_sparse_attention,
)
from tests.models_llama.packing import (
    LENGTHS,
    VOCAB,
    alone_loss,
    packed_loss,
    packed_rows,
    sharded_packed_training,
    spans,
    tiny_hf_llama,
    worst_document_error,
)

TOL = 1e-5
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    sdpa = tiny_hf_llama("sdpa")
    built = {"sdpa": sdpa}
    for impl in ("eager", "flex_attention"):  # the same weights
        built[impl] = tiny_hf_llama(impl)
        built[impl].load_state_dict(sdpa.state_dict())
    return built


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_each_packed_document_matches_the_document_alone(models, impl):
    ids, positions, docs = packed_rows(LENGTHS, vocab=VOCAB, seed=1)
    assert worst_document_error(models[impl], ids, positions, docs) < TOL
    loss = packed_loss(forward_logits(models[impl], ids, position_ids=positions), ids, positions)
    ref = alone_loss(models[impl], [d for row in docs for d in row])
    torch.testing.assert_close(loss, ref, rtol=0, atol=TOL)


def test_packed_training_on_cuda_switches_sdpa_to_flex_attention():
    """On CUDA a model at sdpa attends with flex_attention for packed rows; on the CPU, or at another
    implementation, nothing changes. (torch.device("cuda") is a name: no GPU is needed.)"""
    model = tiny_hf_llama("sdpa")
    assert use_block_sparse_attention(model, device=torch.device("cpu")) is None
    assert model.config._attn_implementation == "sdpa"
    notice = use_block_sparse_attention(model, device=torch.device("cuda"))
    assert "flex_attention" in notice and "--model.kwargs.attn_implementation sdpa" in notice
    assert model.config._attn_implementation == "flex_attention"
    check_packing_static(model)  # the probe would compile flex_attention: test_flex_attention_packs_like_sdpa
    eager = tiny_hf_llama("eager")
    assert use_block_sparse_attention(eager, device=torch.device("cuda")) is None
    assert eager.config._attn_implementation == "eager"


@pytest.mark.slow
def test_flex_attention_packs_like_sdpa(models):
    """Packed rows under flex_attention give sdpa's logits (which equal the documents alone, above).

    Forward only: flex_attention has no backward on the CPU. Slow: transformers compiles flex (about a
    minute on two cores). Not against the documents alone: on the CPU, torch 2.13's compiled flex
    recompiled for a new length gave one unpacked 8-token document wrong logits (0.17 off sdpa's).
    """
    ids, positions, _ = packed_rows(LENGTHS, vocab=VOCAB, seed=2)
    with torch.no_grad():
        flex = forward_logits(models["flex_attention"], ids, position_ids=positions)
        sdpa = forward_logits(models["sdpa"], ids, position_ids=positions)
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=TOL)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_changing_one_document_changes_no_other(models, impl):
    ids, positions, docs = packed_rows(LENGTHS, vocab=VOCAB, seed=3)
    before = forward_logits(models[impl], ids, position_ids=positions)
    changed = ids.clone()
    middle = spans(docs[1])[1]
    changed[1, middle] = (changed[1, middle] + 1) % VOCAB
    after = forward_logits(models[impl], changed, position_ids=positions)
    outside = torch.ones_like(ids, dtype=torch.bool)
    outside[1, middle] = False
    torch.testing.assert_close(before[outside], after[outside], rtol=0, atol=1e-6)
    assert not torch.allclose(before[1, middle], after[1, middle])


def test_the_traps_forward_logits_avoids_do_leak(models):
    """The reasons for its call: a cache (transformers' default) or an all-ones attention_mask turns
    transformers' detection of packed rows off, and documents attend to each other."""
    model = models["sdpa"]
    ids, positions, _ = packed_rows(LENGTHS, vocab=VOCAB, seed=4)
    packed = forward_logits(model, ids, position_ids=positions)
    with_cache = model(input_ids=ids, position_ids=positions).logits
    all_ones = model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids), use_cache=False)
    assert (with_cache - packed).abs().max() > 1e-2
    assert (all_ones.logits - packed).abs().max() > 1e-2


def test_without_position_ids_it_is_the_ordinary_forward(models):
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    expected = models["sdpa"](ids).logits
    torch.testing.assert_close(forward_logits(models["sdpa"], ids, position_ids=None), expected, rtol=0, atol=0)
    linear = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    assert torch.equal(forward_logits(linear, x, position_ids=None), linear(x))


def test_a_peft_model_packs_through_its_base(models):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_hf_llama("sdpa"), config)
    check_packing_supported(model, device=torch.device("cpu"))
    ids, positions, docs = packed_rows(LENGTHS, vocab=VOCAB, seed=6)
    assert worst_document_error(model, ids, positions, docs) < TOL


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_sharded_packed_training_matches_the_documents_alone(pools, world):
    for r in pools(world).run(sharded_packed_training, "hf"):
        assert r["loss"] < TOL and r["weights"] < TOL, r


def test_flash_attention_is_refused_without_a_forward():
    """Refused as certain (transformers' flash kernels separate packed documents only in a batch of one
    row), before any probe: flash_attention_2 need not even be installed."""
    model = tiny_hf_llama("sdpa")
    model.config._attn_implementation = "flash_attention_2"
    message = (
        "LlamaForCausalLM with attn_implementation='flash_attention_2' separates packed documents only in a "
        "batch of one row, so packed batches would leak: load it with attn_implementation='sdpa'"
    )
    with pytest.raises(ValueError, match=message):
        check_packing_static(model)
    with pytest.raises(ValueError, match=message + r".* train unpacked: --data.packing false$"):
        forward_logits(model, torch.zeros(1, 4, dtype=torch.long), position_ids=torch.zeros(1, 4, dtype=torch.long))


def test_models_whose_forward_takes_no_position_ids_are_refused():
    with pytest.raises(ValueError, match="^Linear.forward takes no position_ids"):
        check_packing_supported(nn.Linear(4, 4), device=torch.device("cpu"))
    import transformers

    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=VOCAB)
    )
    with pytest.raises(ValueError, match="^T5ForConditionalGeneration.forward takes no position_ids"):
        check_packing_supported(t5, device=torch.device("cpu"))


def test_position_ids_of_another_shape_are_refused(models):
    with pytest.raises(ValueError, match=r"position_ids of shape \(1, 3\) for input_ids of shape \(1, 4\)"):
        forward_logits(models["sdpa"], torch.zeros(1, 4, dtype=torch.long), position_ids=torch.zeros(1, 3))
