"""An 8B LoRA fine-tune streaming a >= 1 GB local corpus, beside the same run on the cached path (issue 44).

    python benchmarks/streaming_gpu.py --work /tmp/streaming                        # one H100 or H200
    python benchmarks/streaming_gpu.py --work /tmp/streaming-cpu --device cpu --corpus-mb 8 --cached-mb 2 \
        --seq 256 --steps 4 --warmup 1 --create "--layers 2 --hidden 256 --heads 4 --kv-heads 2 \
        --intermediate 512 --vocab 1024"                                           # CPU dry run

Preparation (not timed as a launch):

  model    benchmarks/pretrained_load.py --phases create: a LlamaForCausalLM of Llama-3-8B's shape (32 x 4096,
           vocab 128,256) with random bf16 weights built on the device, saved in <work>/llama (reused when
           present); <work>/model links its weights beside a byte-level BPE tokenizer with a chat template
           trained on the rows (finetune_data.py's)
  corpus   --corpus-mb of chat rows in <work>/corpus.jsonl: finetune_data.py's invented chats of 1-3 turns,
           the pool repeated with a number in each first message (every row distinct); cached.jsonl is its
           first --cached-mb

Then `shardtrain train` processes, --runs in order (default: streamed, cached; a name again runs it again,
after the caches the first runs warmed: files, compiled kernels) (world size 1, LoRA r=16 on every linear layer, every decoder layer
checkpointed, batch 1 x --seq, assistant-only loss, packed):

  streamed  --data.path corpus.jsonl --data.streaming true: rows read, tokenized and packed as training goes
  cached    --data.path cached.jsonl: tokenized into the Arrow cache (--num-proc workers) before the first step;
            a prefix of the corpus, as the tokens/s of training does not depend on the corpus's size

launch -> first step is the wall time from starting the process until metrics.jsonl holds the first step's
record (so it includes that step), launch -> weights loaded until it prints that the weights are in; tokens/s
is the runs' own (metrics.jsonl) over the steps after --warmup; data_load_s the host time spent reading batches
in them. Prints one JSON line per run, a table, and a table of each run's start-up phases (its metrics.jsonl
`startup` record: imports, model, data, sharding, weights, probes, first step).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from finetune_data import FILES, make_rows, make_tokenizer

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="folder of the model, corpus, cache and runs")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--create", default="", help="pretrained_load.py shape arguments (default: Llama-3-8B's)")
    parser.add_argument("--corpus-mb", type=int, default=1100, help="size of the streamed corpus")
    parser.add_argument("--cached-mb", type=int, default=16, help="the corpus's prefix the cached path tokenizes")
    parser.add_argument("--pool", type=int, default=24_000, help="distinct chats the corpus repeats")
    parser.add_argument("--vocab", type=int, default=8_000, help="tokenizer vocabulary (at most the model's)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s (every step is logged)")
    parser.add_argument("--num-proc", type=int, default=8)
    parser.add_argument("--runs", default="streamed,cached", help="the runs, in order (a name twice: run it again)")
    return parser.parse_args()


def prepare_model(args, work: Path) -> Path:
    """<work>/model: the random Llama's config and weights (linked) with the rows' tokenizer."""
    llama = work / "llama"
    create = [sys.executable, str(HERE / "pretrained_load.py"), "--dir", str(llama), "--phases", "create"]
    subprocess.run([*create, "--device", args.device, *shlex.split(args.create)], check=True)
    folder = work / "model"
    folder.mkdir(exist_ok=True)
    for f in llama.iterdir():
        link = folder / f.name
        if (f.name in FILES or f.name.endswith(".safetensors")) and not link.exists():
            link.symlink_to(f.resolve())
    return folder


def write_corpus(args, work: Path, pool: list[dict]) -> tuple[Path, Path]:
    """corpus.jsonl of --corpus-mb (the pool repeated, each row numbered) and cached.jsonl, its first --cached-mb."""
    corpus, cached = work / "corpus.jsonl", work / "cached.jsonl"
    lines = [json.dumps(row) for row in pool]
    target, written, rep = args.corpus_mb * 2**20, 0, 0
    with open(corpus, "w") as out, open(cached, "w") as prefix:
        while written < target:
            for k, line in enumerate(lines):
                text = line.replace('"content": "', f'"content": "{rep}.{k} ', 1) + "\n"
                out.write(text)
                if written < args.cached_mb * 2**20:
                    prefix.write(text)
                written += len(text)
            rep += 1
    return corpus, cached


def train(args, work: Path, name: str, data: Path, *extra: str) -> dict:
    """One `shardtrain train` run: launch -> first step, tokens/s and data_load_s after --warmup."""
    run_dir = work / "runs" / name
    command = [
        sys.executable, "-m", "shardtrain", "train",
        "--model.pretrained", str(work / "model"), "--lora.rank", "16", "--lora.targets", "all-linear",
        "--model.activation_checkpointing", "true", "--data.path", str(data), "--data.seq_len", str(args.seq),
        "--data.num_proc", str(args.num_proc), "--data.cache_dir", str(work / "cache"),
        "--train.batch_size", "1", "--train.steps", str(args.steps), "--train.log_every", "1",
        "--optim.lr", "1e-4", "--engine.devices", "1", "--engine.accelerator", args.device,
        "--run.progress", "false", "--run.out_dir", str(work / "runs"), "--run.name", name, *extra,
    ]  # fmt: skip
    launched = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    loaded: list[float] = []  # when the run printed that its weights are in: the launch's first phase

    def watch() -> None:
        for line in proc.stdout or ():
            if line.startswith("loaded ") and not loaded:
                loaded.append(time.perf_counter() - launched)

    errors: list[str] = []
    readers = [threading.Thread(target=watch), threading.Thread(target=lambda: errors.extend(proc.stderr or ()))]
    for reader in readers:
        reader.start()
    metrics, first_step = run_dir / "metrics.jsonl", None
    while proc.poll() is None and first_step is None:
        if metrics.exists() and '"kind": "train"' in metrics.read_text():
            first_step = time.perf_counter() - launched
        time.sleep(0.05)
    proc.wait()
    for reader in readers:
        reader.join()
    err = "".join(errors)
    if proc.returncode:
        raise RuntimeError(f"{name}: {err[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = [r for r in records if r["kind"] == "train" and r["step"] > args.warmup]
    startup = next(r for r in records if r["kind"] == "startup")  # the run's own start-up phases (rank 0)
    seconds = sum(r["tokens_per_s"] ** -1 for r in timed)  # one step per record: seconds per token each
    return {
        "run": name,
        "launch_to_first_step_s": round(first_step, 2) if first_step is not None else None,
        "launch_to_weights_loaded_s": round(loaded[0], 2) if loaded else None,
        "tokens_per_s": round(len(timed) / seconds, 1),
        "data_load_s": round(sum(r["data_load_s"] for r in timed), 4),
        "loss": f"{timed[0]['loss']:.3f} -> {timed[-1]['loss']:.3f}",
        "startup": {k: v for k, v in startup.items() if k.endswith("_s")},
    }


def main() -> None:
    args = parse_args()
    work = Path(args.work)
    (work / "runs").mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    folder = prepare_model(args, work)
    pool = make_rows(args.pool)
    make_tokenizer(pool, args.vocab).save_pretrained(folder)
    corpus, cached = write_corpus(args, work, pool)
    print(
        f"prepared in {time.perf_counter() - start:.0f} s: corpus {corpus.stat().st_size / 2**30:.2f} GiB", flush=True
    )
    runs = {"streamed": (corpus, "--data.streaming", "true"), "cached": (cached,)}
    results = []
    for k, name in enumerate(args.runs.split(",")):  # a name again: the same run, later (warm caches)
        data, *extra = runs[name]
        results.append({**train(args, work, f"{name}-{k}", data, *extra), "run": name})
    for r in results:
        print(json.dumps(r))
    print(f"| run | launch -> weights loaded s | launch -> first step s | tokens/s (steps {args.warmup + 1}-{args.steps}) "
          "| data load s | loss |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|")
    for r in results:
        print(
            f"| {r['run']} | {r['launch_to_weights_loaded_s']} | {r['launch_to_first_step_s']} | "
            f"{r['tokens_per_s']:,.0f} | {r['data_load_s']} | {r['loss']} |"
        )
    phases = list(dict.fromkeys(k for r in results for k in r["startup"]))
    print(f"| run | {' | '.join(k.removesuffix('_s') for k in phases)} |")
    print(f"|---|{'---:|' * len(phases)}")
    for r in results:
        print(f"| {r['run']} | {' | '.join(str(r['startup'].get(k, '')) for k in phases)} |")
    speed = {r["run"]: r["tokens_per_s"] for r in results}  # the last of each
    print(f"streamed / cached tokens/s: {speed['streamed'] / speed['cached']:.3f}")


if __name__ == "__main__":
    main()
