"""A peft LoRA model set up by Fabric with `ShardtrainStrategy(load_in_4bit=True)` (2 CPU ranks, fp32)
against the same model trained in one process over torchao's dequantised NF4 base.

Run as a script (`python fabric_qlora_run.py OUT_DIR`): Fabric's launcher re-runs it once per device.
Rank 0 writes OUT_DIR/result.json with both loss trajectories and the count of NF4 layers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn

from shardtrain.integrations.fabric import ShardtrainStrategy
from shardtrain.pretrained.nf4 import NF4Linear
from tests.pretrained.hf_models import VOCAB, config
from tests.pretrained.qlora_ranks import dequantized_base

STEPS, LR = 3, 1e-2


def base() -> nn.Module:
    """The same Llama on every process (seeded), with distinct norms."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config("llama_untied"))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def with_lora(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 13), generator=torch.Generator().manual_seed(100 + step))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def train(model: nn.Module, optimizer: torch.optim.Optimizer, rows: slice, backward) -> list[float]:
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, batch(step)[rows])
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def main(out: Path) -> None:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    fabric = L.Fabric(
        accelerator="cpu",
        devices=2,
        strategy=ShardtrainStrategy(wrap={LlamaDecoderLayer}, load_in_4bit=True),
        precision="32-true",
    )
    fabric.launch()
    model = fabric.setup_module(with_lora(base()))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR))
    rank = fabric.global_rank
    losses = [
        float(fabric.all_reduce(x, reduce_op="mean"))
        for x in train(model, optimizer, slice(2 * rank, 2 * rank + 2), fabric.backward)
    ]
    if rank != 0:
        return
    reference = with_lora(dequantized_base(base()))
    ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR)
    ref_losses = [float(x) for x in train(reference, ref_optimizer, slice(None), torch.Tensor.backward)]
    result = {
        "losses": losses,
        "ref_losses": ref_losses,
        "nf4_layers": sum(isinstance(m, NF4Linear) for m in model.modules()),
    }
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
