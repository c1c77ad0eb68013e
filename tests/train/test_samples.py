"""eval.samples' greedy decoding equals transformers' `generate(do_sample=False)` on the same model."""

import pytest
import torch

from shardtrain.train.samples import greedy_samples
from tests.data.tokenizers_fixture import train_tokenizer
from tests.train.facts import questions

transformers = pytest.importorskip("transformers")


def test_greedy_samples_match_generate():
    tok = train_tokenizer([q + " " + a for q, a in questions()], vocab_size=300)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        initializer_range=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    prompts = [
        {"prompt_ids": tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)["input_ids"], "reference": a}
        for q, a in questions()[:3]
    ]  # fmt: skip
    got = greedy_samples(model, prompts, tokenizer=tok, max_new_tokens=8, device="cpu")
    for prompt, row in zip(prompts, got):
        ids = torch.tensor([prompt["prompt_ids"]])
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        assert row["completion"] == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert row["prompt"] == tok.decode(prompt["prompt_ids"]) and row["reference"] == prompt["reference"]
    assert any(row["completion"] for row in got)
