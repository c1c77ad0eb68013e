"""QLoRA on one GPU: the largest Llama-shaped model shardtrain fine-tunes over a 4-bit base, against peft +
bitsandbytes (no sharding) on the same GPU, and tokens/s at the largest size both run.

Each model is a `LlamaForCausalLM` of a Llama shape at full depth (SIZES), built from its config on the meta
device in bf16 with random weights, nothing downloaded; each frozen linear layer is drawn and quantised one
at a time as it is materialised, so neither the host nor the GPU ever holds the bf16 model:

  shardtrain   peft LoRA (all-linear, r 16) on meta -> st.quantize_base (torchao's NF4, double-quantised
               scales) -> st.shard at world size 1 (units: the decoder layers, every one checkpointed,
               bf16 compute, fp32 adapter masters)
  peft_bnb     every decoder-layer linear replaced by bitsandbytes' Linear4bit (NF4, compress_statistics,
               bf16 compute) as it is drawn -> peft LoRA (all-linear, r 16) -> transformers' gradient
               checkpointing of every layer (use_reentrant=False)

Both then take --steps AdamW steps of batch 1 x --seq random tokens (the loss over the full logits in fp32,
the same code for both); tokens/s counts the steps after the first. Each (engine, size) runs in a child
process; the engines climb the ladder (--sizes) size by size, each stopping at its first out-of-memory, and
no child starts after --budget seconds.

    python benchmarks/qlora_gpu.py                          # 8B and 70B shapes, both engines: about 5 minutes
    python benchmarks/qlora_gpu.py --sizes 110b             # past 70B, when both fit it
    python benchmarks/qlora_gpu.py --sizes 70b --engines shardtrain --compile-dequant   # the fused dequantisation
    python benchmarks/qlora_gpu.py --device cpu --sizes tiny --seq 64 --steps 2   # a dry run on the CPU

Needs peft, transformers, torchao (shardtrain[qlora]) and bitsandbytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's shardtrain
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

# (hidden, layers, heads, kv heads, ffn, vocab): Llama-3 8B and 70B, a 14B and a 34B of Llama's proportions,
# and a 110B (70B's layer, 128 of them)
SIZES = {
    "tiny": (128, 2, 4, 2, 256, 512),
    "8b": (4096, 32, 32, 8, 14336, 128256),
    "14b": (5120, 48, 40, 8, 13824, 128256),
    "34b": (8192, 48, 64, 8, 22016, 128256),
    "70b": (8192, 80, 64, 8, 28672, 128256),
    "110b": (8192, 128, 64, 8, 28672, 128256),
}
ENGINES = ("shardtrain", "peft_bnb")
LORA_RANK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8b,70b", help=f"the ladder, from {','.join(SIZES)}")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--seq", type=int, default=4096, help="tokens per step (batch 1)")
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is left out of tokens/s")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--budget", type=float, default=280.0, help="seconds after which no run starts")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds one run may take")
    parser.add_argument(
        "--compile-dequant", action="store_true", help="shardtrain dequantises through torch.compile (nf4.py)"
    )
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "SIZE"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def hf_config(size: str):
    from transformers import LlamaConfig

    dim, layers, heads, kv, ffn, vocab = SIZES[size]
    return LlamaConfig(
        hidden_size=dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=ffn,
        vocab_size=vocab,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear", lora_dropout=0.0)


def build_shardtrain(size: str, device):
    import torch
    import torch.distributed as dist
    from peft import get_peft_model
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import shardtrain as st

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    with torch.device("meta"):
        model = get_peft_model(LlamaForCausalLM._from_config(hf_config(size), dtype=torch.bfloat16), lora_config())
    init = st.quantize_base(model)
    st.shard(
        model,
        wrap={LlamaDecoderLayer},
        activation_checkpointing={LlamaDecoderLayer},
        mixed_precision="bf16",
        device=device,
        param_init_fn=init,
    )
    return model


def build_peft_bnb(size: str, device):
    import bitsandbytes as bnb
    import torch
    from peft import get_peft_model
    from torch import nn
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = hf_config(size)
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, _linear4bit(bnb, child, device))
        layer.input_layernorm.to_empty(device=device).weight.data.fill_(1.0)
        layer.post_attention_layernorm.to_empty(device=device).weight.data.fill_(1.0)
    for module in (model.model.embed_tokens, model.lm_head):
        module.to_empty(device=device)
        nn.init.normal_(module.weight, std=config.initializer_range)
    model.model.norm.to_empty(device=device).weight.data.fill_(1.0)
    model.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)  # its tables, computed on the host
    for p in model.parameters():
        p.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return get_peft_model(model, lora_config())


def _linear4bit(bnb, linear, device):
    """bitsandbytes' NF4 layer of `linear`'s shape, its weight drawn as nn.Linear draws it and quantised."""
    import torch

    weight = torch.empty(linear.out_features, linear.in_features, dtype=torch.bfloat16, device=device)
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    out = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=False,
        compute_dtype=torch.bfloat16,
        compress_statistics=True,
        quant_type="nf4",
        device="meta",
    )
    out.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=True).to(device)
    return out


def child(engine: str, size: str, args) -> dict:
    import torch
    import torch.nn.functional as F

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    vocab = SIZES[size][5]
    torch.manual_seed(0)
    start = time.perf_counter()
    if args.compile_dequant:
        from shardtrain.pretrained.nf4 import compile_dequantize

        compile_dequantize()
    model = (build_shardtrain if engine == "shardtrain" else build_peft_bnb)(size, device)
    built_s = time.perf_counter() - start
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    generator = torch.Generator().manual_seed(0)
    times, losses = [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, vocab, (1, args.seq + 1), generator=generator).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=engine == "peft_bnb"):
            logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        del logits
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - step)
    timed = times[1:] or times
    return {
        "engine": engine,
        "size": size,
        "fits": all(math.isfinite(x) for x in losses),
        "tokens_s": round(args.seq * len(timed) / sum(timed), 1),
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "build_s": round(built_s, 1),
        "step_s": [round(t, 2) for t in times],
        "losses": [round(x, 3) for x in losses],
        "trainable_m": round(sum(p.numel() for p in trainable) / 1e6, 1),
    }


def run_child(engine: str, size: str, args) -> dict:
    command = [sys.executable, __file__, "--child", engine, size, "--seq", str(args.seq), "--steps", str(args.steps)]
    command += ["--device", args.device] + (["--compile-dequant"] if args.compile_dequant else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "size": size, "fits": None, "error": f"timed out after {args.timeout:g} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    oom = "OutOfMemoryError" in done.stderr or "out of memory" in done.stderr.lower()
    tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
    return {
        "engine": engine,
        "size": size,
        "fits": False if oom else None,
        "error": "out of memory" if oom else tail[0],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        try:
            print(json.dumps(child(*args.child, args)), flush=True)
        except Exception as exc:  # the parent reads out-of-memory from stderr
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return 1
        return 0
    start = time.perf_counter()
    results: dict[str, list[dict]] = {engine: [] for engine in args.engines.split(",")}
    for size in args.sizes.split(","):
        for engine, runs in results.items():  # size by size, so both engines reach the same sizes in the budget
            if runs and not runs[-1].get("fits"):
                continue  # this engine stopped at its first failure
            if time.perf_counter() - start > args.budget:
                print(f"budget of {args.budget:g} s spent: {engine} {size} not run", flush=True)
                continue
            result = run_child(engine, size, args)
            runs.append(result)
            print(json.dumps(result), flush=True)
    summary = {
        engine: max((r["size"] for r in runs if r.get("fits")), key=list(SIZES).index, default=None)
        for engine, runs in results.items()
    }
    both = [s for s in SIZES if all(any(r["size"] == s and r.get("fits") for r in runs) for runs in results.values())]
    line = {"largest": summary, "seconds": round(time.perf_counter() - start)}
    if both and len(results) == 2:
        rate = {e: next(r["tokens_s"] for r in results[e] if r["size"] == both[-1]) for e in results}
        line["tokens_s_at"] = {"size": both[-1], **rate, "ratio": round(rate["shardtrain"] / rate["peft_bnb"], 3)}
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
