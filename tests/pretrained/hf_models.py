"""Tiny Hugging Face models saved with `save_pretrained`, the inputs of the pretrained-loading tests.

Row counts (vocabulary 259, hidden 64, kv projections 32) are not multiples of 3 or 4, so shards of
3 and 4 ranks end unevenly and the last ranks hold fewer rows.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 259
MODELS = ("llama_tied", "llama_untied", "gpt2", "llama_split")


def config(kind: str):
    from transformers import GPT2Config, LlamaConfig

    if kind == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
        )
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=kind == "llama_tied",
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
    )


def save(kind: str, folder: Path, *, seed: int = 0) -> Path:
    """A randomly initialised `kind` (fp32) saved to `folder`; "llama_split" in several files with an index."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(kind))
    with torch.no_grad():  # distinct norms, so a norm loaded into the wrong place shows
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, **({"max_shard_size": "100KB"} if kind == "llama_split" else {}))
    return folder


def block_names(kind: str) -> set[str]:
    return {"GPT2Block"} if kind == "gpt2" else {"LlamaDecoderLayer"}
