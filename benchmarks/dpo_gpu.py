"""LoRA DPO tokens/s of an 8B-shaped Llama: shardtrain (st.shard, one GPU) against TRL's DPOTrainer + peft unsharded.

One process, one GPU, the same random-weight model (Llama 3 8B's widths; fewer layers with --layers to fit
both runs in one call), the same random preference pairs (prompt and answers of --prompt / --answer tokens),
bf16 compute, LoRA r=16 on q_proj,v_proj, AdamW, no gradient checkpointing, --steps timed after --warmup.

    shardtrain   the policy is the peft model sharded by st.shard (bf16 mixed precision); the reference is
                 the base with the adapters disabled; the loss is shardtrain.train.dpo_loss's
    reference    TRL's DPOTrainer (precompute off, padding-free off) in a child process of its own, when trl
                 imports; else, or when that run fails (its error printed), a plain-peft loop written from the
                 DPO formula (printed as such): log-probabilities of both answers with and without the
                 adapters, -log sigmoid(beta x margin), AdamW, under bf16 autocast

Tokens/s counts every position of both answers' rows (2 x pairs x (prompt + answer)) per second.
Run: python benchmarks/dpo_gpu.py [--layers 8] [--pairs 4]; writes a JSON line to stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def model_config(layers: int, *, small: bool):
    from transformers import LlamaConfig

    if small:  # a CPU smoke test of the script itself
        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)  # fmt: skip


def lora_model(config, device):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(config).to(torch.bfloat16)
    return get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])).to(device)


def pairs_batch(args, vocab: int, device) -> dict[str, torch.Tensor]:
    """`args.pairs` pairs as the n chosen rows then the n rejected, answers scored (shardtrain's layout)."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (args.pairs, args.prompt), generator=g)
    answers = torch.randint(0, vocab, (2 * args.pairs, args.answer), generator=g)
    ids = torch.cat([prompt.repeat(2, 1), answers], dim=1)
    labels = torch.full_like(ids, -100)
    labels[:, args.prompt - 1 : -1] = answers
    return {"input_ids": ids.to(device), "labels": labels.to(device), "pair": torch.arange(args.pairs, device=device)}


def timed(step, *, warmup: int, steps: int, device) -> float:
    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def shardtrain_step(args, config, device):
    import torch.distributed as dist

    import shardtrain as st
    from shardtrain.train.dpo_loss import dpo_terms
    from shardtrain.train.dpo_ref import LiveReference
    from shardtrain.train.packed import forward_logits

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)  # fmt: skip
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = lora_model(config, device)
    st.shard(model, wrap={LlamaDecoderLayer}, mixed_precision="bf16" if device.type == "cuda" else None, device=device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    batch, reference = pairs_batch(args, config.vocab_size, device), LiveReference(model=model, adapters_off=True)
    n = args.pairs

    def step():
        from shardtrain.train.dpo_loss import sequence_logps

        ref = reference.logps(batch)
        logps = sequence_logps(forward_logits(model, batch["input_ids"], position_ids=None), batch["labels"])
        terms = dpo_terms(chosen_logps=logps[:n], rejected_logps=logps[n:], ref_chosen_logps=ref[:n],
                          ref_rejected_logps=ref[n:], beta=0.1)  # fmt: skip
        terms.losses.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def formula_step(args, config, device):
    """The plain-peft reference loop, written from the DPO formula (used when trl is not installed)."""
    model = lora_model(config, device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    batch, n = pairs_batch(args, config.vocab_size, device), args.pairs

    def logps():
        logits = model(input_ids=batch["input_ids"]).logits.float()
        picked = torch.log_softmax(logits, -1).gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0]
        return (picked * (batch["labels"] != -100)).sum(-1)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            with torch.no_grad(), model.disable_adapter():
                ref = logps()
            pi = logps()
        loss = -F.logsigmoid(0.1 * ((pi[:n] - ref[:n]) - (pi[n:] - ref[n:]))).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def trl_seconds(args, config, device) -> float:
    """Seconds per step of TRL's DPOTrainer + peft on the same model and pairs (from its own step timing)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model = lora_model(config, device).merge_and_unload()  # DPOTrainer adds the adapters from peft_config
    from peft import LoraConfig

    g = torch.Generator().manual_seed(1)
    rows = args.pairs * (args.warmup + args.steps)
    words = min(config.vocab_size, 4096) - 3

    def texts(k: int) -> list[str]:  # k words of the stand-in vocabulary: k tokens
        return [" ".join(f"w{i}" for i in row) for row in torch.randint(0, words, (rows, k), generator=g).tolist()]

    data = Dataset.from_dict(
        {"prompt": texts(args.prompt), "chosen": texts(args.answer - 1), "rejected": texts(args.answer - 1)}
    )  # fmt: skip (TRL appends EOS to answers)
    times: list[float] = []
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            torch.cuda.synchronize() if device.type == "cuda" else None
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize() if device.type == "cuda" else None
            times.append(time.perf_counter() - self.start)

    config_args = DPOConfig(output_dir="/tmp/dpo_gpu_trl", per_device_train_batch_size=args.pairs, max_steps=args.warmup + args.steps,
                            learning_rate=1e-5, beta=0.1, bf16=device.type == "cuda", gradient_checkpointing=False,
                            max_length=args.prompt + args.answer, report_to="none", save_strategy="no",
                            logging_steps=1000, use_cpu=device.type != "cuda", disable_tqdm=True)  # fmt: skip
    trainer = DPOTrainer(model=model, args=config_args, train_dataset=data, callbacks=[Clock()], processing_class=_tokenizer(words),
                         peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))  # fmt: skip
    trainer.train()
    return sum(times[args.warmup :]) / args.steps


def _tokenizer(words: int):
    """A word-level tokenizer of `words` words w0, w1, ... (random text of k words is k tokens) for TRL."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--answer", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="a tiny model on the CPU: checks the script runs")
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device("cpu" if args.small else "cuda")
    config = model_config(args.layers, small=args.small)
    if args.trl_child:  # TRL's run, in a process of its own: no process group, a fresh GPU
        print(json.dumps({"seconds": trl_seconds(args, config, device)}))
        return
    tokens = 2 * args.pairs * (args.prompt + args.answer)
    result = {"layers": args.layers, "pairs": args.pairs, "seq": args.prompt + args.answer}
    result["shardtrain_tokens_per_s"] = tokens / timed(shardtrain_step(args, config, device), warmup=args.warmup,
                                                       steps=args.steps, device=device)  # fmt: skip
    torch.cuda.empty_cache() if device.type == "cuda" else None
    seconds = trl_child(sys.argv[1:])
    if seconds is not None:
        import trl

        result["reference"] = f"trl {trl.__version__} DPOTrainer + peft"
    else:
        result["reference"] = "plain peft, the DPO formula (TRL's run failed or trl is not installed)"
        seconds = timed(formula_step(args, config, device), warmup=args.warmup, steps=args.steps, device=device)
    result["reference_tokens_per_s"] = tokens / seconds
    print(json.dumps(result))


def trl_child(argv: list[str]) -> float | None:
    """Seconds per step of TRL's run in a child process, or None (its error's first and last lines printed)."""
    try:
        import trl  # noqa: F401
    except ImportError:
        return None
    done = subprocess.run([sys.executable, __file__, *argv, "--trl-child"], capture_output=True, text=True)
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    lines = [line for line in done.stderr.splitlines() if "warn" not in line.lower()]
    print("TRL's run failed:", *lines[:25], "...", *lines[-15:], sep="\n", file=sys.stderr)
    return None


if __name__ == "__main__":
    main()
