"""Rank-side code of the planning tests: the measured peak of a small training step on the CPU.

The peak is that of the tensors alive, read from torch's memory profiler (its timeline of tensor
creations and destructions, tensors alive at its start included): what `max_memory_allocated()`
reports on a GPU, without a GPU. The step is the second (the first allocates the optimizer state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action, MemoryProfile

import shardtrain as st

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN = 512, 256, 2, 4, 2, 704
LORA = dict(rank=8, alpha=16.0, targets=("q_proj", "v_proj"), dropout=0.0)


def hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
    )


def meta_model(*, lora: bool) -> nn.Module:
    """The test model on the meta device, as `shardtrain train` builds it under bf16-mixed: a LoRA base in
    bf16 with peft's adapters, a fully trained model in fp32."""
    from transformers import AutoModelForCausalLM

    from shardtrain.pretrained.lora import apply_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(), dtype=torch.bfloat16 if lora else torch.float32)
    return apply_lora(model, **LORA) if lora else model


def blocks() -> set[type[nn.Module]]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {LlamaDecoderLayer}


def _peak(step) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        step()
    live = peak = 0
    for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline:
        if action in (Action.PREEXISTING, Action.CREATE):
            live += size
        elif action is Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def measured_peak(*, lora: bool, checkpointing: bool, micro_batch: int, seq_len: int) -> int:
    """Peak bytes of the tensors alive during the second training step (bf16 compute, AdamW)."""
    from shardtrain.pretrained.lora import adapter_init

    torch.manual_seed(0)
    model = meta_model(lora=lora)
    st.shard(
        model,
        strategy="full_shard",
        wrap=blocks(),
        mixed_precision="bf16",
        activation_checkpointing=blocks() if checkpointing else None,
        param_init_fn=adapter_init(model) if lora else None,
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = torch.randint(0, VOCAB, (micro_batch, seq_len + 1), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        del logits
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    return _peak(step)
