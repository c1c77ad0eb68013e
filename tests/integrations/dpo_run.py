"""TRL's DPOTrainer under DDP against DPOTrainer with the shardtrain mixin, under torchrun (2 CPU ranks, fp32).

`torchrun --nproc_per_node=2 dpo_run.py OUT [MODE ...]` (default: every mode): for each mode both runs train
10 steps on the same preference pairs from the same weights; rank 0 writes OUT/result.json with, per mode,
both runs' losses and reward metrics. `full`: TRL builds the reference model from the policy's folder;
`lora`: peft adapters, the reference is the policy with them disabled (TRL's default gradient
checkpointing on, in every mode); `precompute`: precompute_ref_log_probs=True (the reference log-probabilities computed once).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset, load_from_disk
from transformers import LlamaForCausalLM

from shardtrain.integrations.transformers import ShardtrainTrainerMixin
from tests.integrations.hf_run import WRAP, losses, model, tokenizer

STEPS = 10
MODES = ("full", "lora", "precompute", "lora_precompute")


def pairs() -> Dataset:
    """Prompt / chosen / rejected rows: the chosen completion is the function's true body, the rejected a wrong one.
    (main() saves them to disk: precompute_ref_log_probs caches beside the dataset's files, which every rank reads.)"""
    prompts = [f"def f{i}(x):\n" for i in range(64)]
    chosen = [f"    return x * {i} + {i % 7}\n" for i in range(64)]
    rejected = [f"    return x - {i % 5}\n" for i in range(64)]
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def train(out: Path, mode: str, *, sharded: bool) -> dict:
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    class ShardtrainDPOTrainer(ShardtrainTrainerMixin, DPOTrainer):
        pass

    lora = mode.startswith("lora")
    args = DPOConfig(
        output_dir=str(out / mode / ("st" if sharded else "ddp")),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-2 if lora else 1e-3,
        beta=0.1,
        max_length=32,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        precompute_ref_log_probs=mode.endswith("precompute"),
        bf16=False,  # TRL's default is bf16: the comparison is at fp32
        **(dict(fsdp="full_shard auto_wrap", fsdp_config={"transformer_layer_cls_to_wrap": WRAP}) if sharded else {}),
    )
    policy = LlamaForCausalLM.from_pretrained(out / "base")  # its name_or_path: TRL builds the reference from it
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None
    cls = ShardtrainDPOTrainer if sharded else DPOTrainer
    data = load_from_disk(str(out / "pairs"))
    trainer = cls(model=policy, args=args, train_dataset=data, processing_class=tokenizer(), peft_config=peft_config)
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "losses": losses(trainer),
        "margins": [h["rewards/margins"] for h in history],
        "accuracies": [h["rewards/accuracies"] for h in history],
        "sharded": all(hasattr(p, "to_local") for p in trainer.model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("modes", nargs="*", help=f"some of {', '.join(MODES)} (default: all)")
    args = parser.parse_args()
    if set(args.modes) - set(MODES):
        parser.error(f"modes {args.modes}: use some of {', '.join(MODES)}")
    warnings.filterwarnings("ignore")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        model().save_pretrained(args.out / "base")
        pairs().save_to_disk(str(args.out / "pairs"))
    dist.barrier()
    result = {}
    for mode in args.modes or MODES:
        torch.manual_seed(0)
        result[mode] = {"ddp": train(args.out, mode, sharded=False), "sharded": train(args.out, mode, sharded=True)}
    if dist.get_rank() == 0:
        (args.out / "result.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main()
