"""Train a small Llama with `st.Engine` in your own loop.

    python examples/train_engine.py                              # every GPU, else 2 CPU processes
    torchrun --nproc_per_node=2 examples/train_engine.py         # the same, started by torchrun
    python examples/train_engine.py --size 7m --steps 200 --grad-accum 2

Run plainly, `engine.launch()` re-runs this script in one process per device; under torchrun it
joins the process group torchrun set up. The data is the Python standard library's source, as
bytes (see shardtrain.train.data).
"""

from __future__ import annotations

import argparse
import time

import torch

import shardtrain as st
from shardtrain.models.llama import Block, Llama, llama_config
from shardtrain.train.data import ByteTokenizer, TokenBatches, build_cache, corpus_files


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2m", help="a key of shardtrain.models.llama.LLAMA_SIZES")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step, all ranks")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--devices", default="auto", help="'auto' or a number of processes")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--data", default=None, help="a text file or directory (default: the Python stdlib)")
    parser.add_argument("--cache-dir", default=None, help="where to cache the tokenized data")
    parser.add_argument("--save", default=None, help="save a checkpoint here at the end")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    engine = st.Engine(
        devices=args.devices if args.devices == "auto" else int(args.devices),
        accelerator=args.accelerator,
        strategy="full_shard",
        wrap={Block},
    )
    engine.launch()
    engine.seed_everything(0)

    root, files = corpus_files(args.data, "**/*.py")
    with engine.rank_zero_first(local=True):  # tokenize once per node; the others read the cache
        cache = build_cache(
            root=root,
            files=files,
            val_fraction=0.02,
            cache_dir=args.cache_dir,
            tokenizer=ByteTokenizer(),
            progress=engine.local_rank == 0,
        )
    micro_batch = args.batch_size // args.grad_accum
    batches = TokenBatches(
        cache.train,
        seq_len=args.seq_len,
        global_batch=micro_batch,
        rank=engine.rank,
        world_size=engine.world_size,
        seed=0,
        shuffle=True,
    )

    with engine.init_module(empty_init=True):  # built on the meta device, materialised unit by unit
        model = Llama(llama_config(args.size))
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0))

    start = time.perf_counter()
    for step in range(args.steps):
        total = 0.0
        for micro in range(args.grad_accum):
            batch = batches.batch(step * args.grad_accum + micro)
            inputs, targets = batch["input_ids"].to(engine.device), batch["labels"].to(engine.device)
            with engine.no_backward_sync(model, enabled=micro < args.grad_accum - 1):
                loss = model.loss(inputs, targets) / args.grad_accum
                engine.backward(loss)
            total += loss.item()
        norm = engine.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            mean = engine.all_reduce(torch.tensor(total)).item()
            engine.print(f"step {step:4d}  loss {mean:.4f}  grad norm {norm.item():.3f}")
    tokens = args.steps * args.batch_size * args.seq_len
    engine.print(
        f"done: {engine.world_size} ranks on {engine.device.type}, "
        f"{tokens / (time.perf_counter() - start):,.0f} tokens/s"
    )
    if args.save:
        engine.save(args.save, {"model": model, "optimizer": optimizer, "step": args.steps})
        engine.print(f"saved {args.save}")


if __name__ == "__main__":
    main()
