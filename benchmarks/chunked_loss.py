"""Issue 46's acceptance 2: an 8B LoRA step with every layer checkpointed, the loss over the full logits
against the chunked loss (train.chunked_loss: train/head_loss.py, st.chunked_cross_entropy; Liger's
fused kernel on CUDA when installed): tokens/s at batch 1 x 4096, and the longest sequence that fits
at batch 1 (the goals: >= 1.0x and >= 1.5x).

One process, one GPU: a transformers LlamaForCausalLM of Llama-3-8B's shape (random bf16 weights, no
download), peft LoRA r=16 on q_proj and v_proj, every decoder layer checkpointed; one step = forward,
loss, backward (no optimizer: the adapters' step is the same for both losses).

1. tokens/s and peak memory at 4096: a warm-up step, then `--steps` timed steps, per loss.
2. The longest sequence: a step at `--probe` tokens gives a second peak; with flash attention and
   checkpointing, a step's peak grows linearly with the length, so the two peaks predict the longest
   length (a multiple of 1024) whose peak stays under the device's memory, at most `--max-seq` (a
   longer step takes minutes in attention alone; a capped length is a lower bound, and says so). One
   step at that length confirms it (on an out-of-memory error: 5% shorter, at most 3 times); its own
   peak is printed beside the line's.

Prints one JSON line per measurement and a last line with the ratios. `--smoke` runs a tiny model on the
CPU (no memory numbers, no search) to check the script. About 3 minutes on one H100 (the confirmation
step of the chunked loss, near 100k tokens, is most of it).

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/chunked_loss.py
    python benchmarks/chunked_loss.py --smoke
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
LOSSES = ("full logits", "chunked")
GRAIN = 1024  # the longest length is a multiple of this
MAX_SEQ = 131072


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096, help="the length of the tokens/s comparison")
    parser.add_argument("--probe", type=int, default=8192, help="the second length of the memory line")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per loss at --seq")
    parser.add_argument("--max-seq", type=int, default=MAX_SEQ, help="the longest length tried (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    return parser.parse_args()


def build(shape: dict, *, device: torch.device, dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, max_position_embeddings=MAX_SEQ, tie_word_embeddings=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: an fp32 8B would not leave room to cast
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))


def step(model, ids: torch.Tensor, labels: torch.Tensor, *, loss_kind: str) -> None:
    if loss_kind == "chunked":
        loss = head_loss_sum(model, ids, labels=labels, position_ids=None)
    else:
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
        del logits
    loss.backward()
    model.zero_grad(set_to_none=True)


def run_steps(model, *, seq: int, loss_kind: str, steps: int, warmup: int, device: torch.device, vocab: int) -> dict:
    """`warmup` steps, then `steps` timed ones; tokens/s and the timed steps' peak allocated GiB."""
    generator = torch.Generator(device=device).manual_seed(seq)
    ids = torch.randint(0, vocab, (1, seq), device=device, generator=generator)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    for _ in range(warmup):
        step(model, ids, labels, loss_kind=loss_kind)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step(model, ids, labels, loss_kind=loss_kind)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "seq": seq,
        "loss": loss_kind,
        "kernel": ("liger" if fused_kernel() is not None and cuda else "torch chunks")
        if loss_kind == "chunked"
        else None,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
        "tokens_per_s": round(steps * seq / seconds, 1),
        "step_s": round(seconds / steps, 3),
    }


def fits(model, *, seq: int, loss_kind: str, device: torch.device, vocab: int) -> dict | None:
    """One step at `seq`: its row, or None when it runs out of memory."""
    try:
        return run_steps(model, seq=seq, loss_kind=loss_kind, steps=1, warmup=0, device=device, vocab=vocab)
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return None


def longest(model, *, first: dict, second: dict, cap: int, device: torch.device, vocab: int) -> dict:
    """The longest multiple of GRAIN that the line through two (seq, peak) points puts under the device's
    memory, confirmed by a step (module docstring)."""
    free, _ = torch.cuda.mem_get_info(device)
    capacity_gib = (free + torch.cuda.memory_reserved(device)) / 2**30  # what this process may allocate
    slope = (second["peak_gib"] - first["peak_gib"]) / (second["seq"] - first["seq"])
    predicted = int((capacity_gib - first["peak_gib"]) / slope + first["seq"]) // GRAIN * GRAIN
    seq, loss_kind = min(predicted, cap), first["loss"]
    for _ in range(4):
        row = fits(model, seq=seq, loss_kind=loss_kind, device=device, vocab=vocab)
        if row is not None:
            expected = first["peak_gib"] + slope * (seq - first["seq"])
            line = {"predicted": predicted, "capped": predicted > cap, "line_peak_gib": round(expected, 3)}
            return {**row, "longest": seq, **line}
        seq = int(seq * 0.95) // GRAIN * GRAIN
    return {"loss": loss_kind, "longest": None, "predicted": predicted, "error": "out of memory below the prediction"}


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: pass --smoke for the CPU check")
    shape = SMOKE if args.smoke else EIGHT_B
    seq, probe = (32, 64) if args.smoke else (args.seq, args.probe)
    torch.manual_seed(0)
    model = build(shape, device=device, dtype=torch.float32 if args.smoke else torch.bfloat16)
    vocab = shape["vocab_size"]
    at_seq = {}
    for loss_kind in LOSSES:
        at_seq[loss_kind] = run_steps(
            model, seq=seq, loss_kind=loss_kind, steps=args.steps, warmup=1, device=device, vocab=vocab
        )
        print(json.dumps(at_seq[loss_kind]), flush=True)
    summary = {
        "tokens_per_s_ratio": round(at_seq["chunked"]["tokens_per_s"] / at_seq["full logits"]["tokens_per_s"], 3)
    }
    if device.type == "cuda":
        reach = {}
        for loss_kind in LOSSES:
            second = fits(model, seq=probe, loss_kind=loss_kind, device=device, vocab=vocab)
            if second is None:
                raise SystemExit(f"{loss_kind}: out of memory at --probe {probe}; pass a shorter --probe")
            print(json.dumps(second), flush=True)
            reach[loss_kind] = longest(
                model, first=at_seq[loss_kind], second=second, cap=args.max_seq, device=device, vocab=vocab
            )
            print(json.dumps(reach[loss_kind]), flush=True)
        full, chunked = reach["full logits"]["longest"], reach["chunked"]["longest"]
        summary["longest"] = {"full logits": full, "chunked": chunked}
        summary["longest_ratio"] = round(chunked / full, 3) if full and chunked else None
        summary["chunked_capped"] = reach["chunked"].get("capped")
        summary["device"] = torch.cuda.get_device_name(device)
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
