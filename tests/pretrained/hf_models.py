"""Tiny Hugging Face models saved with `save_pretrained`, the inputs of the pretrained-loading tests.

Row counts (vocabulary 259, hidden 64, kv projections 32) are not multiples of 3 or 4, so shards of
3 and 4 ranks end unevenly and the last ranks hold fewer rows. "llama_wide" (hidden 128, intermediate
256) is the source of the bitsandbytes folders (`save_bnb`): every row of its linear layers is whole
blocks of 64 values, which bitsandbytes' CPU kernel (its own model's forward) needs.
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
    wide = kind == "llama_wide"
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128 if wide else 64,
        intermediate_size=256 if wide else 96,
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


BNB_MODES = ("nf4_dq", "nf4", "fp4", "int8")


def save_bnb(source: Path, folder: Path, mode: str) -> Path:
    """`source` (a save_pretrained folder) loaded by transformers quantised by bitsandbytes on the CPU, in
    bf16, and saved as it is: the layout of the Hub's `*-bnb-4bit` checkpoints. `mode`: "nf4_dq" (NF4
    with double-quantised scales, what those checkpoints use), "nf4", "fp4" or "int8" (LLM.int8)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if mode == "int8":
        quantization = BitsAndBytesConfig(load_in_8bit=True)
    else:
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=mode[:3],
            bnb_4bit_use_double_quant=mode == "nf4_dq",
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    model = AutoModelForCausalLM.from_pretrained(
        source, quantization_config=quantization, device_map="cpu", dtype=torch.bfloat16
    )
    model.save_pretrained(folder)
    return folder


def block_names(kind: str) -> set[str]:
    return {"GPT2Block"} if kind == "gpt2" else {"LlamaDecoderLayer"}
