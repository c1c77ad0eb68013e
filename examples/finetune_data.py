"""Fine-tune a Hugging Face causal LM on your own rows with `st.data` and `st.Engine`, in your own loop.

    python examples/finetune_data.py --model path/to/model --data chat.jsonl      # your folder and rows
    python examples/finetune_data.py                                              # a self-made demo

The rows may be .jsonl/.json/.parquet/.arrow/.csv, a folder of them or a `save_to_disk` folder, in any
layout `shardtrain.data` detects (text, prompt + completion, messages). Without --model the script makes
a demo: a tiny random Llama with a BPE tokenizer and chat template learned from 24 invented facts, and
teaches it those facts. Needs `pip install 'shardtrain[hf]'`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import shardtrain as st
from shardtrain.train.packed import forward_logits


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face model folder (default: build a demo)")
    parser.add_argument("--data", default=None, help="the rows (default: the demo's facts)")
    parser.add_argument("--out", default="runs/finetune_data", help="where the demo and the cache go")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8, help="windows per optimizer step, all ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--devices", default="auto", help="'auto' or a number of processes")
    return parser.parse_args()


def make_demo(out: Path) -> tuple[Path, Path]:
    """A random LlamaForCausalLM + BPE tokenizer with a chat template, and 24 chat rows to learn."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    names = ["Zor", "Bel", "Qua", "Mir", "Tan", "Vek", "Dra", "Sin"]
    facts = [(a + b.lower() + "ia", b + a.lower()) for a in names for b in names[:4] if a != b][:24]
    rows = [
        {"messages": [{"role": "user", "content": f"Capital of {x}?"}, {"role": "assistant", "content": y}]}
        for x, y in facts
    ]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([f"Capital of {x}? {y}" for x, y in facts], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
        "{{ m['content'] }}</s>{% endgeneration %}{% else %}<|user|>{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model_dir, data = out / "demo-model", out / "demo-chat.jsonl"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def main() -> None:
    args = parse_args()
    engine = st.Engine(devices=args.devices if args.devices == "auto" else int(args.devices), strategy="full_shard")
    engine.launch()
    engine.seed_everything(0)
    out = Path(args.out)
    model_dir, data = Path(args.model or out / "demo-model"), Path(args.data or out / "demo-chat.jsonl")
    with engine.rank_zero_first():
        if args.model is None and engine.rank == 0:
            model_dir, data = make_demo(out)
        tokenizer = st.data.load_tokenizer(str(model_dir), key="--model")
        spec = st.data.DataSpec(path=str(data), eval_path=str(data), seq_len=args.seq_len)  # packed by default
        prepared = st.data.prepare(spec, tokenizer=tokenizer, cache_dir=str(out / "cache"), progress=engine.rank == 0)
    engine.print(prepared.stats.describe())
    engine.print(st.data.show(prepared.train, tokenizer, count=2))
    batches = st.data.WindowBatches(
        prepared.train, seq_len=args.seq_len, pad_id=tokenizer.pad_token_id or 0,
        global_batch=args.batch_size, rank=engine.rank, world_size=engine.world_size, seed=0, shuffle=True,
    )  # fmt: skip

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    units = {type(m) for m in model.modules() if type(m).__name__ in model._no_split_modules}  # the decoder layers
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=args.lr), wrap=units)
    for step in range(args.steps):
        batch = {k: t.to(engine.device) for k, t in batches.batch(step).items()}
        # The loss per trained token of the whole global batch: one all-reduce of the count, then each rank's
        # sum scaled by world / count (the engine averages gradients over the ranks).
        count = engine.all_reduce((batch["labels"] != st.data.IGNORE).sum().float(), op="sum")
        logits = forward_logits(
            model, batch["input_ids"], position_ids=batch["position_ids"]
        )  # no cross-document attention
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum")
        engine.backward(loss * engine.world_size / count)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == args.steps - 1:
            engine.print(
                f"step {step:4d}  loss per trained token {engine.all_reduce(loss.detach(), op='sum').item() / count.item():.4f}"
            )


if __name__ == "__main__":
    main()
