"""Rank-side code of tests/core/test_recompute.py: a forward without gradients between a training
forward and its backward (a DPO reference pass on the same weights, self-distillation, a probe).

Each case runs the loop on the sharded model and replays it on an unsharded copy without activation
checkpointing, every rank's micro-batch one by one, averaging the gradients over ranks as data
parallelism does; the rank returns the largest differences of losses and gradients, and how many
parameter all-gathers each phase of the loop issued.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import shardtrain as st
from shardtrain.core.collectives import Collective, observe
from shardtrain.core.shard_module import runtime_of
from tests.core.shapes import hf_llama

PATTERNS = {
    # "train": a training forward; "probe": a forward under no_grad; then one backward of every training loss
    "probe_between": ("train", "probe"),
    "two_forwards": ("train", "probe", "train", "probe"),
}


def _llama(lora: bool) -> nn.Module:
    torch.manual_seed(0)
    model = hf_llama()
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():  # B starts at zero; give it values so that A's gradient is not zero either
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def _whole(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _probe_context(model: nn.Module, lora: bool):
    """TRL's reference pass with LoRA: the same weights with the adapters switched off."""
    return model.disable_adapter() if lora else contextlib.nullcontext()


def _run(
    model: nn.Module, batch: torch.Tensor, pattern: str, lora: bool, phase: list[str]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The loop's losses (probes included) and the summed training loss, not yet backpropagated;
    `phase[0]` names the step running."""
    losses, total = [], None
    for step in PATTERNS[pattern]:
        phase[0] = step
        if step == "train":
            loss = model(input_ids=batch, labels=batch).loss
            total = loss if total is None else total + loss
            losses.append(loss.detach())
        else:
            with torch.no_grad(), _probe_context(model, lora):
                losses.append(model(input_ids=batch, labels=batch).loss)
    assert total is not None
    return losses, total


def probe_between_forward_and_backward(*, strategy: str, ac: bool, lora: bool, pattern: str, steps: int = 2) -> dict:
    """Largest loss and gradient differences against the plain loop over `steps` optimizer steps, and
    the parameter all-gathers per phase ("train", "probe", "backward") over all steps."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    plain = _llama(lora)
    model = st.shard(
        copy.deepcopy(plain),
        strategy=strategy,
        wrap={LlamaDecoderLayer},
        activation_checkpointing={LlamaDecoderLayer} if ac else None,
    )
    model.train()
    plain.train()
    world, rank = dist.get_world_size(), dist.get_rank()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.1)
    generator = torch.Generator().manual_seed(5)
    order = runtime_of(model).order
    phase = [""]
    gathers: Counter[str] = Counter()

    def count(c: Collective) -> None:  # the parameters' all-gathers, not the order check's announcements
        if c.kind == "all_gather" and (order is None or c.group is not order.group):
            gathers[phase[0]] += 1

    worst_loss = worst_grad = 0.0
    for _ in range(steps):
        tokens = torch.randint(0, 96, (2 * world, 8), generator=generator)
        with observe(count):
            losses, total = _run(model, tokens[2 * rank : 2 * rank + 2], pattern, lora, phase)
            phase[0] = "backward"
            total.backward()
        grads = {n: _whole(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        ref_total = 0.0
        for r in range(world):
            ref_losses, ref_r = _run(plain, tokens[2 * r : 2 * r + 2], pattern, lora, [""])
            ref_total = ref_total + ref_r / world
            if r == rank:
                worst_loss = max(worst_loss, *((a - b).abs().item() for a, b in zip(losses, ref_losses)))
        ref_total.backward()
        expected = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
        if grads.keys() != expected.keys():
            return {"names": sorted(grads.keys() ^ expected.keys())}
        worst_grad = max(worst_grad, *((grads[n] - g).abs().max().item() for n, g in expected.items()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    return {"names": [], "loss": worst_loss, "grad": worst_grad, "gathers": dict(gathers)}
