"""Training step throughput of the integrations against `st.shard` in a plain loop, on one GPU.

The same Hugging Face LlamaForCausalLM (the built-in 1.5B's shape: 16 layers, dim 2048, vocabulary
128256), built on the meta device, trained in bf16 (fp32 masters) with fused AdamW and clipping
at 1.0, batch 2 x 4096, through three paths in one process, one after the other:

    plain    st.shard + a hand-written loop (the reference)
    fabric   L.Fabric(strategy=ShardtrainStrategy(...), precision="bf16-mixed"), the guide's loop
    trainer  ShardtrainTrainer(TrainingArguments(bf16=True, ...)).train()

    torchrun --nproc_per_node=1 benchmarks/integrations_step.py [--steps 10 --warmup 3 --layers 16]
    torchrun --nproc_per_node=1 benchmarks/integrations_step.py --paths plain,fabric,trainer,plain,fabric
    torchrun --nproc_per_node=1 benchmarks/integrations_step.py --smoke --layers 2   # CPU: checks the script

Prints one row per path (tokens/s over the timed steps, the ratio to plain, peak memory) and a
JSON line with the same numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's shardtrain

BATCH = 2
# The built-in 1.5B's shape; --smoke: a tiny one, to check the script on the CPU (Gloo, fp32 timings).
SHAPES = {
    "1.5b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=16, seq=4096),
    "smoke": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, seq=64),
}


def llama(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {k: v for k, v in SHAPES[args.shape].items() if k != "seq"}
    config = LlamaConfig(
        **shape,
        num_hidden_layers=args.layers,
        num_key_value_heads=shape["num_attention_heads"] // 2,
        max_position_embeddings=SHAPES[args.shape]["seq"],
        rope_theta=500000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def tokens(args, device: torch.device) -> torch.Tensor:
    shape = SHAPES[args.shape]
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, shape["vocab_size"], (BATCH, shape["seq"]), generator=generator).to(device)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timer:
    """Seconds between the end of step `warmup` and the end of step `warmup + steps`."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps, self.start, self.seconds = warmup, steps, None, None

    def step_done(self, step: int) -> None:  # step counts from 1
        if step in (self.warmup, self.warmup + self.steps):
            synchronize()
            if step == self.warmup:
                self.start = time.perf_counter()
            else:
                self.seconds = time.perf_counter() - self.start


def plain(args, timer: Timer, *, as_fabric: bool = False) -> None:
    """`as_fabric`: also the per-step work Fabric's loop asks for: every float output cast to fp32
    (precision="bf16-mixed") and the clipping's non-finite check (`error_if_nonfinite=True`, its
    default), which reads the norm on the host."""
    import shardtrain as st

    model = llama(args)
    st.shard(model, wrap={LlamaDecoderLayer}, mixed_precision=args.mixed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.fused)
    ids = tokens(args, DEVICE)
    for step in range(1, args.warmup + args.steps + 1):
        out = model(input_ids=ids, labels=ids)
        if as_fabric:
            out.logits = out.logits.float()
        out.loss.backward()
        del out  # as `model(...).loss.backward()` would: the logits do not outlive the step
        st.clip_grad_norm_(model, 1.0, error_if_nonfinite=as_fabric)
        opt.step()
        opt.zero_grad()
        timer.step_done(step)


def fabric(args, timer: Timer, *, cast_outputs: bool = True) -> None:
    import lightning as L

    from shardtrain.integrations.fabric import ShardtrainStrategy

    precision = "bf16-mixed" if args.mixed else "32-true"
    strategy = ShardtrainStrategy(wrap={LlamaDecoderLayer})
    runner = L.Fabric(accelerator=DEVICE.type, devices=1, strategy=strategy, precision=precision)
    runner.launch()
    if not cast_outputs:  # Fabric casts every float output (the bf16 logits too) to fp32; this skips it
        strategy.precision.convert_output = lambda data: data
    with runner.init_module(empty_init=True):
        model = llama(args)
    model = runner.setup_module(model)
    opt = runner.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.fused))
    ids = tokens(args, runner.device)
    for step in range(1, args.warmup + args.steps + 1):
        runner.backward(model(input_ids=ids, labels=ids).loss)
        runner.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        timer.step_done(step)


def trainer(args, timer: Timer) -> None:
    from transformers import TrainerCallback, TrainingArguments

    from shardtrain.integrations.transformers import ShardtrainTrainer

    class Steps(TrainerCallback):
        def on_step_end(self, training_args, state, control, **kwargs):
            timer.step_done(state.global_step)

    ids = tokens(args, torch.device("cpu"))[0]
    data = [{"input_ids": ids, "labels": ids}] * (BATCH * (args.warmup + args.steps))
    training = TrainingArguments(
        output_dir="/tmp/integrations_step",
        per_device_train_batch_size=BATCH,
        max_steps=args.warmup + args.steps,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        optim="adamw_torch_fused" if args.fused else "adamw_torch",
        max_grad_norm=1.0,
        bf16=bool(args.mixed),
        use_cpu=DEVICE.type == "cpu",
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    ShardtrainTrainer(model=llama(args), args=training, train_dataset=data, callbacks=[Steps()]).train()


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PATHS: dict[str, Callable] = {
    "plain": plain,
    "fabric": fabric,
    "trainer": trainer,
    # Not user paths: Fabric's loop without its fp32 cast of the outputs, and the plain loop with the
    # per-step work Fabric's loop asks for, to see what those cost.
    "plain-as-fabric": lambda args, timer: plain(args, timer, as_fabric=True),
    "fabric-uncast": lambda args, timer: fabric(args, timer, cast_outputs=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--paths", default="plain,fabric,trainer")
    parser.add_argument("--smoke", action="store_true", help="a tiny model in fp32 on the CPU (checks the script)")
    args = parser.parse_args()
    args.shape, args.mixed, args.fused = ("smoke", None, False) if args.smoke else ("1.5b", "bf16", True)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo")  # torchrun's environment
    rows = {}
    for i, name in enumerate(args.paths.split(",")):
        gc.collect()
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        timer = Timer(args.warmup, args.steps)
        PATHS[name](args, timer)
        # A path named twice (e.g. plain,fabric,trainer,plain) gets a second row: the order's effect.
        rows[name if name not in rows else f"{name}#{i}"] = {
            "tokens_per_s": BATCH * SHAPES[args.shape]["seq"] * args.steps / timer.seconds,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else float("nan"),
        }
    base = rows.get("plain", {}).get("tokens_per_s")
    print(f"{'path':14} {'tokens/s':>10} {'x plain':>8} {'peak GiB':>9}")
    for name, row in rows.items():
        ratio = row["tokens_per_s"] / base if base else float("nan")
        row["ratio"] = ratio
        print(f"{name:14} {row['tokens_per_s']:10.0f} {ratio:8.3f} {row['peak_gib']:9.1f}")
    seq = SHAPES[args.shape]["seq"]
    print(json.dumps({"shape": args.shape, "batch": BATCH, "seq": seq, "layers": args.layers, "rows": rows}))


if __name__ == "__main__":
    main()
