"""What the start-up probes cost under transformers' flex_attention: compiled frames and seconds.

    python benchmarks/probe_compiles.py                      # CUDA when present, else the CPU
    python benchmarks/probe_compiles.py --device cpu --hidden 64 --layers 2

A packed fine-tune of a transformers model runs two probes before its first step (train/packing_probe.py:
does the model keep packed documents apart; train/head_loss.py: does the chunked loss reproduce its loss).
They are no-grad forwards of the real model, so a kernel compiled per shape and mask function (flex_attention
and its block mask, compiled by transformers) compiles for every shape and mask kind they use. This builds a
LlamaForCausalLM from a config (random weights, nothing downloaded) at flex_attention, runs both probes as
the training loop does, and prints one JSON line: the frames dynamo compiled and the seconds the probes took.
Run it against two source trees (PYTHONPATH=<tree>/src) to compare them.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    args = parser.parse_args()

    import transformers
    from torch._dynamo.utils import counters

    from shardtrain.train import head_loss
    from shardtrain.train.packed import check_packing_supported

    device = torch.device(args.device)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="flex_attention")
    model = model.to(device=device, dtype=dtype)
    packed = {"packed": True} if "packed" in inspect.signature(head_loss.probe).parameters else {}
    start = time.perf_counter()
    check_packing_supported(model, device=device)
    verdict = head_loss.probe(model, device=device, **packed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "compiled_frames": counters["frames"]["total"],
                "seconds": round(seconds, 2),
                "chunked_loss_probe": verdict.reason or "accepted",
            }
        )
    )


if __name__ == "__main__":
    main()
