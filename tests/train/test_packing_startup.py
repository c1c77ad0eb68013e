"""The training loop's start-up refuses, on every rank of a sharded run, a model that lets packed
documents attend to each other (OPT, which passes every static check), in one line; unpacked, the
same model builds."""

import re

import pytest

from tests.train.facts import llama_folder, prompt_completion_rows, write_jsonl
from tests.train.packing_ranks import build_outcome

pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def opt_case(tmp_path_factory):
    """An OPT folder with the facts' tokenizer, its rows and a cache directory."""
    import torch
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

    root = tmp_path_factory.mktemp("opt")
    tokenizer = AutoTokenizer.from_pretrained(llama_folder(root / "llama", hidden=32, layers=1))
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=128,
        word_embed_proj_dim=32,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    folder = root / "opt"
    OPTForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = write_jsonl(prompt_completion_rows()[:24], root / "rows.jsonl")
    return str(folder), str(rows), str(root / "cache")


def test_a_leaking_model_is_refused_at_start_up_on_every_rank(pools, opt_case):
    refusal = re.compile(
        r"OPTForCausalLM lets packed documents attend to each other: a document's logits packed differ from the "
        r"document alone by up to (\S+) \(allowed \S+\) and move by up to (\S+) when another document of its row "
        r"changes \(allowed \S+; float32, largest logit \S+\); train unpacked: --data.packing false"
    )
    outcomes = pools(2).run(build_outcome, *opt_case)
    assert len(set(outcomes)) == 1, outcomes  # every rank measured the same
    match = refusal.fullmatch(outcomes[0])
    assert match, outcomes[0]
    assert float(match[1]) > 1e-3 and float(match[2]) > 1e-3
    assert pools(2).run(build_outcome, *opt_case, "--data.packing", "false") == ["built", "built"]
