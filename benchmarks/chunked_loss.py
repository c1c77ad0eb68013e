"""Peak memory and tokens/s of an 8B-shaped LoRA step with the loss over the full logits and in chunks
(train.chunked_loss: train/head_loss.py, st.chunked_cross_entropy; Liger's kernel on CUDA when installed).

One process, one GPU: a transformers LlamaForCausalLM of Llama-3-8B's shape (random bf16 weights, no
download), peft LoRA r=16 on q_proj and v_proj, every decoder layer checkpointed, batch 1. For each
sequence length and each loss, a warm-up step then `--steps` timed steps (forward, loss, backward);
prints one JSON line per (length, loss) with the peak allocated GiB and tokens/s. `--smoke` runs a tiny
model on the CPU (no memory numbers), to check the script.

    python benchmarks/chunked_loss.py                       # CUDA: seq 1024 .. 16384
    python benchmarks/chunked_loss.py --seq 4096 8192 --steps 5
    python benchmarks/chunked_loss.py --smoke               # CPU
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from shardtrain.models.chunked_ce import fused_kernel
from shardtrain.train.head_loss import head_loss_sum

EIGHT_B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)
SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths (default: 1024 .. 16384)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per (length, loss)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    return parser.parse_args()


def build(shape: dict, *, device: torch.device, dtype: torch.dtype, max_len: int):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, max_position_embeddings=max_len, tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))


def step(model, ids: torch.Tensor, labels: torch.Tensor, *, chunked: bool) -> None:
    if chunked:
        loss = head_loss_sum(model, ids, labels=labels, position_ids=None)
    else:
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
        del logits
    loss.backward()


def measure(model, *, seq: int, chunked: bool, steps: int, device: torch.device, vocab: int) -> dict:
    ids = torch.randint(0, vocab, (1, seq), device=device)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    step(model, ids, labels, chunked=chunked)  # warm-up
    model.zero_grad(set_to_none=True)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step(model, ids, labels, chunked=chunked)
        model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "seq": seq,
        "loss": "chunked" if chunked else "full logits",
        "kernel": ("liger" if fused_kernel() is not None and cuda else "torch chunks") if chunked else None,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "tokens_per_s": round(steps * seq / seconds, 1),
    }


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: pass --smoke for the CPU check")
    shape = SMOKE if args.smoke else EIGHT_B
    lengths = args.seq or ([32, 64] if args.smoke else [1024, 2048, 4096, 8192, 16384])
    dtype = torch.float32 if args.smoke else torch.bfloat16
    torch.manual_seed(0)
    model = build(shape, device=device, dtype=dtype, max_len=max(lengths))
    for seq in lengths:
        for chunked in (False, True):
            try:
                row = measure(
                    model, seq=seq, chunked=chunked, steps=args.steps, device=device, vocab=shape["vocab_size"]
                )
            except torch.OutOfMemoryError:
                row = {"seq": seq, "loss": "chunked" if chunked else "full logits", "error": "out of memory"}
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
