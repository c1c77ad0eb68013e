"""`ShardtrainTrainer(load_in_4bit=True)` on a peft LoRA Llama against `transformers.Trainer` (DDP) on the
same model whose frozen linears are torchao's dequantised NF4, under torchrun (2 CPU ranks, fp32).

`torchrun --nproc_per_node=2 hf_qlora_run.py OUT`: rank 0 writes OUT/result.json with both runs' losses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from torch import nn
from transformers import Trainer

from shardtrain.integrations.transformers import ShardtrainTrainer
from shardtrain.pretrained.nf4 import NF4Linear
from tests.integrations.hf_run import arguments, dataset, losses, model, tokenizer
from tests.pretrained.qlora_ranks import dequantized_base

STEPS = 3


def with_lora(base: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


def main(out: Path) -> None:
    tok = tokenizer()
    data = dataset(tok, 0, 16)
    common = dict(max_steps=STEPS, save_strategy="no", max_grad_norm=1.0, learning_rate=1e-2)
    reference = Trainer(
        model=with_lora(dequantized_base(model())), args=arguments(out / "ddp", **common), train_dataset=data
    )
    reference.train()
    trainer = ShardtrainTrainer(
        model=with_lora(model()), args=arguments(out / "st", **common), train_dataset=data, load_in_4bit=True
    )
    trainer.train()
    if dist.get_rank() == 0:
        result = {
            "losses": losses(trainer),
            "ref_losses": losses(reference),
            "nf4_layers": sum(isinstance(m, NF4Linear) for m in trainer.model.modules()),
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
