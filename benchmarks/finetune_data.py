"""Fine-tuning a pretrained folder on a packed chat dataset, beside the same run on pre-tokenised windows.

    python benchmarks/pretrained_load.py --dir /tmp/llama8b --phases create       # the 8B folder, once
    python benchmarks/finetune_data.py --model /tmp/llama8b --work /tmp/ftdata     # one H200
    python benchmarks/finetune_data.py --model /tmp/tiny-llama --work /tmp/ftdata --device cpu --rows 2000 \
        --seq 256 --steps 6 --warmup 2                                              # CPU dry run

Phases (each `shardtrain train` a fresh process, world size 1 on CUDA):

  data     --rows invented chat rows of varied length (rows.jsonl); a byte-level BPE tokenizer with a
           chat template trained on them; <work>/model = the folder's config and weights (symlinked) with
           that tokenizer, <work>/bytes-model = the same without it (so the run reads UTF-8 bytes)
  prepare  st.data.prepare on the rows into a fresh cache: rows/s (tokenize + mask + pack, --num-proc
           workers) and packing efficiency
  packed   shardtrain train --model.pretrained <work>/model --data.path rows.jsonl: packed windows
           of --seq tokens through the leak-free forward (block-diagonal attention by position_ids)
  windows  the same run on <work>/bytes-model and the rows' text as one plain file: contiguous
           pre-tokenised windows of --seq tokens, plain causal forward

tokens/s is the runs' own (window capacity per second, metrics.jsonl) over the log intervals after the
first --warmup steps; data_load_s is the host time spent reading batches in them. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face model folder (weights, config)")
    parser.add_argument("--work", required=True, help="folder for the rows, the tokenizer, the cache and the runs")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rows", type=int, default=24_000)
    parser.add_argument("--vocab", type=int, default=8_000, help="tokenizer vocabulary (at most the model's)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of tokens/s (log every step)")
    parser.add_argument("--num-proc", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-5)
    return parser.parse_args()


def make_rows(n: int, seed: int = 0) -> list[dict]:
    """Chats of 1-3 turns whose answers run from a few words to a few hundred."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("aeioubcdfghklmnprstvz") for _ in range(rng.randint(2, 9))) for _ in range(3_000)]
    say = lambda k: " ".join(rng.choice(words) for _ in range(k)).capitalize() + "."  # noqa: E731
    rows = []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(1, 3)):
            messages += [
                {"role": "user", "content": say(rng.randint(5, 40))},
                {"role": "assistant", "content": say(int(rng.paretovariate(1.2) * 20) % 600 + 3)},
            ]
        rows.append({"messages": messages})
    return rows


def make_tokenizer(rows: list[dict], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((m["content"] for r in rows for m in r["messages"]), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
        "{{ m['content'] }}</s>{% endgeneration %}{% else %}<|user|>{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return fast


def phase_data(args, work: Path) -> dict:
    rows = make_rows(args.rows)
    (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "rows.txt").write_text("\n".join(m["content"] for r in rows for m in r["messages"]))
    for name in ("model", "bytes-model"):
        folder = work / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for f in Path(args.model).iterdir():
            if f.name in FILES or f.name.endswith(".safetensors"):
                (folder / f.name).symlink_to(f.resolve())
    make_tokenizer(rows, args.vocab).save_pretrained(work / "model")
    return {"note": f"{len(rows):,} rows, {(work / 'rows.jsonl').stat().st_size / 2**20:.1f} MiB"}


def phase_prepare(args, work: Path) -> dict:
    import shardtrain as st

    tokenizer = st.data.load_tokenizer(str(work / "model"), key="--model")
    shutil.rmtree(work / "prepare-cache", ignore_errors=True)
    start = time.perf_counter()
    prepared = st.data.prepare(
        st.data.DataSpec(path=str(work / "rows.jsonl"), seq_len=args.seq),
        tokenizer=tokenizer,
        cache_dir=str(work / "prepare-cache"),
        num_proc=args.num_proc,
    )
    seconds = time.perf_counter() - start
    return {
        "rows_per_s": prepared.stats.rows / seconds,
        "packing_efficiency": prepared.stats.packing_efficiency,
        "note": prepared.stats.describe(),
    }


def train(args, work: Path, name: str, model: str, data: str) -> dict:
    run = subprocess.run(
        [
            sys.executable, "-m", "shardtrain", "train",
            "--model.pretrained", str(work / model), "--data.path", str(work / data),
            "--data.seq_len", str(args.seq), "--data.num_proc", str(args.num_proc),
            "--data.cache_dir", str(work / "cache"), "--train.batch_size", "1", "--train.steps", str(args.steps),
            "--train.log_every", "1", "--train.eval_every", "0", "--train.eval_batches", "1",
            "--optim.lr", str(args.lr), "--model.activation_checkpointing", "true",
            "--engine.devices", "1", "--engine.accelerator", args.device, "--run.progress", "false",
            "--run.out_dir", str(work / "runs"), "--run.name", name,
        ],
        capture_output=True, text=True,
    )  # fmt: skip
    if run.returncode:
        raise RuntimeError(f"{name}: {run.stderr[-2000:]}")
    records = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["kind"] == "train" and r["step"] > args.warmup]
    seconds = sum(r["tokens_per_s"] ** -1 for r in timed)  # one step per record: seconds per token each
    return {
        "tokens_per_s": len(timed) / seconds,
        "data_load_s": sum(r["data_load_s"] for r in timed),
        "step_s": args.seq * seconds / len(timed),
        "loss": f"{timed[0]['loss']:.3f} -> {timed[-1]['loss']:.3f}",
    }


def main() -> None:
    args = parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "runs", ignore_errors=True)
    results = {"data": phase_data(args, work), "prepare": phase_prepare(args, work)}
    results["packed"] = train(args, work, "packed", "model", "rows.jsonl")
    results["windows"] = train(args, work, "windows", "bytes-model", "rows.txt")
    ratio = results["packed"]["tokens_per_s"] / results["windows"]["tokens_per_s"]
    print(json.dumps(results, indent=1))
    print(f"| run | tokens/s | step s | data load s (steps {args.warmup + 1}-{args.steps}) | loss |")
    print("|---|---:|---:|---:|---|")
    for name in ("packed", "windows"):
        r = results[name]
        print(f"| {name} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | {r['data_load_s']:.3f} | {r['loss']} |")
    print(f"packed / windows tokens/s: {ratio:.3f}")
    prep = results["prepare"]
    print(f"prepare: {prep['rows_per_s']:,.0f} rows/s, packing efficiency {prep['packing_efficiency']:.1%}")


if __name__ == "__main__":
    main()
