"""transformers causal LMs of many families on packed rows, through `forward_logits`: each either
gives every packed document the logits of the document alone (fp32), or is refused in one line before
any packed forward. OPT takes `position_ids` and builds its masks with `masking_utils`, yet its mask
builder never sees the positions: the probe refuses it for what it measures. BLOOM takes no
`position_ids` and is refused without a forward. Both do attend across documents when run packed."""

import pytest
import torch

from shardtrain.train.packed import forward_logits
from tests.models_llama.packing import LENGTHS, packed_rows, spans, worst_document_error

pytest.importorskip("transformers")
VOCAB = 100
TOL = 1e-5
_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
)


def _families() -> dict[str, tuple[str, object, str]]:
    """family -> (model class name, its tiny config, attn_implementation); sliding windows of 4 tokens,
    shorter than the documents, so the sliding-window masks are exercised too."""
    import transformers as t

    kv = dict(num_key_value_heads=2, **_SMALL)
    return {
        "llama": ("LlamaForCausalLM", t.LlamaConfig(**kv), "sdpa"),
        "qwen2": ("Qwen2ForCausalLM", t.Qwen2Config(**kv), "sdpa"),
        "qwen3": ("Qwen3ForCausalLM", t.Qwen3Config(head_dim=8, **kv), "sdpa"),
        "mistral": ("MistralForCausalLM", t.MistralConfig(sliding_window=4, **kv), "sdpa"),
        "mixtral": ("MixtralForCausalLM", t.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **kv), "sdpa"),
        "gemma": ("GemmaForCausalLM", t.GemmaConfig(head_dim=8, **kv), "sdpa"),
        "gemma2": ("Gemma2ForCausalLM", t.Gemma2Config(head_dim=8, sliding_window=4, **kv), "eager"),
        "phi3": ("Phi3ForCausalLM", t.Phi3Config(pad_token_id=0, **kv), "sdpa"),
        "gpt2": ("GPT2LMHeadModel", t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4), "sdpa"),
        "gpt_neox": ("GPTNeoXForCausalLM", t.GPTNeoXConfig(**_SMALL), "sdpa"),
        "falcon": (
            "FalconForCausalLM",
            t.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
            "sdpa",
        ),
        "opt": (
            "OPTForCausalLM",
            t.OPTConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                ffn_dim=64,
                num_attention_heads=4,
                word_embed_proj_dim=32,
                pad_token_id=1,
            ),
            "sdpa",
        ),
        "bloom": ("BloomForCausalLM", t.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4), "eager"),
    }


# family -> how its refusal begins: OPT by the probe (what it measured), BLOOM before any forward
REFUSED = {
    "opt": "OPTForCausalLM lets packed documents attend to each other: ",
    "bloom": "BloomForCausalLM.forward takes no position_ids, so packed documents would attend to each other: ",
}
FAMILIES = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "mixtral",
    "gemma",
    "gemma2",
    "phi3",
    "gpt2",
    "gpt_neox",
    "falcon",
    "opt",
    "bloom",
]


def _build(family: str):
    import transformers

    name, config, impl = _families()[family]
    torch.manual_seed(0)
    model = getattr(transformers, name)._from_config(config, attn_implementation=impl)
    return model.eval()  # GPT-2's dropout would make packed and alone differ


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_packs_exactly_or_is_refused(family):
    model = _build(family)
    ids, positions, docs = packed_rows(LENGTHS, vocab=VOCAB, seed=7)
    with torch.no_grad():
        if family not in REFUSED:
            assert worst_document_error(model, ids, positions, docs) < TOL
            return
        with pytest.raises(ValueError) as refused:
            forward_logits(model, ids, position_ids=positions)
        # the model called directly, as forward_logits would: changing a row's first document moves the next
        changed = ids.clone()
        changed[:, : LENGTHS[0][0]] = (changed[:, : LENGTHS[0][0]] + 1) % VOCAB
        before, after = (model(input_ids=x, position_ids=positions, use_cache=False).logits for x in (ids, changed))
        second = spans(docs[0])[1]
        assert (before[0, second] - after[0, second]).abs().max() > 1e-3
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(REFUSED[family])
    assert message.endswith("train unpacked: --data.packing false")
