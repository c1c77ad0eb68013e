"""The memory estimate of a LoRA fine-tune beside its measured peak, and what strategy="auto" picks.

One GPU, world size 1. A `LlamaForCausalLM` of Llama-3-8B's shape (32 layers x 4096, vocab 128,256,
untied head) is built from its config on the meta device in bf16, given peft LoRA adapters (r=8,
alpha=16, q_proj and v_proj), and sharded by `st.shard` (full_shard over `LlamaDecoderLayer`, bf16
compute, the frozen base stored in bf16, fp32 masters for the adapters), which initialises the
weights at random on the GPU: nothing is downloaded or read from disk. Then, for each of no
activation checkpointing and every decoder layer checkpointed, --steps steps of batch 1 x --seq with
fused AdamW (the step of benchmarks/pretrained_load.py), each configuration in a model of its own:

  measured   torch.cuda.max_memory_allocated() over the steps, tokens/s over the steps after --warmup
  estimated  st.estimate_memory of the same peft model (meta device, requires_grad read from it)

and the automatic plan (`planning.cost.shard_auto.resolve_auto`, as `st.shard_auto` runs it, and
`train.planned_config.resolve_auto_config`, as `shardtrain train --model.pretrained DIR --lora.rank 8
--engine.strategy auto` runs it) for this GPU, with whether it chose the faster measured configuration
among those that fit.

    python benchmarks/lora_estimate.py                 # one H200: about 2 minutes
    python benchmarks/lora_estimate.py --device cpu --layers 2 --hidden 256 --heads 4 --kv-heads 2 \\
        --intermediate 704 --vocab 512 --seq 256 --steps 3 --warmup 1   # a dry run of the script on the CPU

On the CPU nothing is measured (no allocator statistics) and the plan is made for --device-memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's shardtrain
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as pretrained_load.py

from pretrained_load import fine_tune, init_process_group

TARGETS = ("q_proj", "v_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq", type=int, default=4096, help="tokens per step (batch 1)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of tokens/s")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--device-memory", default=None, help="plan for this much (default: the GPU's)")
    return parser.parse_args(argv)


def hf_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(8192, args.seq),
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )


def peft_model(args):
    """The LoRA model on the meta device: the base in bf16 (frozen), the adapters as peft makes them."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardtrain.pretrained.lora import apply_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(args), dtype=torch.bfloat16)
    return apply_lora(model, rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets=TARGETS, dropout=0.0)


def blocks():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {LlamaDecoderLayer}


def measure(args, device, *, checkpointing: bool) -> dict:
    import torch

    import shardtrain as st
    from shardtrain.pretrained.lora import adapter_init

    model = peft_model(args)
    st.shard(
        model,
        strategy="full_shard",
        wrap=blocks(),
        mixed_precision="bf16",
        activation_checkpointing=blocks() if checkpointing else None,
        device=device,
        param_init_fn=adapter_init(model),
    )
    out = fine_tune(args, device, model, [p for p in model.parameters() if p.requires_grad])
    out["peak_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def estimate(args, *, checkpointing: bool):
    import shardtrain as st

    return st.estimate_memory(
        peft_model(args),
        world_size=1,
        wrap=blocks(),
        precision="bf16",
        activation_checkpointing=checkpointing,
        micro_batch=1,
        seq_len=args.seq,
    )


def train_config_choice(args):
    """What `shardtrain train --model.pretrained DIR --lora.rank R --engine.strategy auto` would choose here."""
    from shardtrain.train.config import load_config
    from shardtrain.train.planned_config import resolve_auto_config

    with tempfile.TemporaryDirectory() as folder:
        hf_config(args).save_pretrained(folder)  # config.json; the plan builds on meta, it reads no weights
        (Path(folder) / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
        overrides = ["--model.pretrained", folder, "--lora.rank", str(args.lora_rank), "--lora.targets"]
        overrides += [",".join(TARGETS), "--engine.strategy", "auto", "--engine.accelerator", "cuda"]
        overrides += ["--engine.devices", "1", "--data.seq_len", str(args.seq), "--train.batch_size", "1"]
        _, choice = resolve_auto_config(load_config(None, overrides), device_memory=args.memory)
    return choice


def main(argv: list[str] | None = None) -> int:
    import torch

    from shardtrain.planning.cost.shard_auto import resolve_auto
    from shardtrain.planning.cost.sizes import GiB, parse_bytes

    args = parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    args.memory = parse_bytes(args.device_memory) if args.device_memory else None
    if args.memory is None:
        if device.type != "cuda":
            raise SystemExit("--device cpu: give --device-memory (e.g. 141GB) to plan for")
        args.memory = torch.cuda.get_device_properties(device).total_memory
    init_process_group(device)
    rows = []
    for checkpointing in (False, True):
        measured = measure(args, device, checkpointing=checkpointing)
        bill = estimate(args, checkpointing=checkpointing)
        rows.append((checkpointing, measured, bill))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"\nLlama {args.layers} x {args.hidden}, LoRA r={args.lora_rank} on {','.join(TARGETS)}, bf16 base "
        f"frozen, batch 1 x {args.seq}, {name}, planned for {args.memory / GiB:.2f} GiB"
    )
    print(f"{'activation checkpointing':<26} {'tokens/s':>9} {'measured GiB':>13} {'estimated GiB':>14} {'error':>7}")
    for checkpointing, measured, bill in rows:
        peak = measured["peak_bytes"]
        label = "every layer" if checkpointing else "none"
        print(
            f"{label:<26} {measured['tokens_s']:>9,.0f} {f'{peak / GiB:.2f}' if peak else '-':>13} "
            f"{bill.total / GiB:>14.2f} {f'{bill.total / peak - 1:+.1%}' if peak else '-':>7}   ({measured['note']})"
        )
    auto = resolve_auto(
        peft_model(args), world_size=1, micro_batch=1, seq_len=args.seq, wrap=blocks(), device_memory=args.memory
    )
    config_choice = train_config_choice(args)
    fits = [(c, m) for c, m, _ in rows if (m["peak_bytes"] or 0) <= args.memory]
    fastest = max(fits, key=lambda cm: cm[1]["tokens_s"])[0] if fits else None
    picked = auto.recompute_every > 0
    print(f"\nst.shard_auto: {auto}")
    print(
        f"\nshardtrain train --engine.strategy auto: {config_choice.strategy.value}, activation checkpointing "
        f"{config_choice.activation_checkpointing}"
    )
    agrees = fastest is not None and picked == fastest and (config_choice.recompute_every > 0) == fastest
    print(f"picked the faster measured configuration that fits: {'yes' if agrees else 'NO'}")
    return 0 if agrees else 1


if __name__ == "__main__":
    sys.exit(main())
