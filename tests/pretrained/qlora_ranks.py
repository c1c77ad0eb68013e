"""Rank-side code of the QLoRA tests (run on every rank of a `pools(n)` process group)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

import shardtrain as st
from shardtrain.core.held import held_params
from shardtrain.core.shard_module import runtime_of
from shardtrain.pretrained.nf4 import COMPONENTS
from tests.pretrained import load_export_ranks as ranks
from tests.pretrained.hf_models import VOCAB

LORA = {**ranks.LORA, "dropout": 0.0}  # dropout draws differ between the sharded model and the reference


def setup(folder: str, strategy: str = "full_shard", *, targets=ranks.LORA["targets"]) -> nn.Module:
    return ranks.sharded(folder, strategy, lora={**LORA, "targets": targets}, base_bits=4)


def reference(folder: str, adapters: dict[str, torch.Tensor], *, targets) -> nn.Module:
    """The same quantised model in one process, built without shardtrain: `from_pretrained` (fp32), peft's
    LoRA, each frozen linear weight but the head replaced by torchao's dequantised NF4 of it, and the
    sharded model's adapters copied in."""
    from peft import LoraConfig, get_peft_model

    model = dequantized_base(ranks.reference(folder).train())
    modules = targets[0] if targets == ("all-linear",) else list(targets)  # peft reads its shorthand as a string
    peft = get_peft_model(
        model, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=modules, lora_dropout=0.0)
    )
    state = peft.state_dict()
    assert set(adapters) <= set(state), sorted(set(adapters) - set(state))[:3]
    peft.load_state_dict({**state, **adapters})
    return peft


def dequantized_base(model: nn.Module) -> nn.Module:
    """`model` (a transformers model) with each linear weight but the head's replaced, in place, by
    torchao's NF4 of it, dequantised: the base a QLoRA model computes with, by code we did not write."""
    from torchao.quantization import to_nf4

    head = model.get_output_embeddings()
    for module in model.modules():
        if type(module) is nn.Linear and module is not head:
            blocks = module.weight.numel() // 64
            nf4 = to_nf4(module.weight.detach(), 64, min(256, blocks & -blocks))
            module.weight.data.copy_(nf4.get_original_weight())
    return model


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (2 * dist.get_world_size(), 13), generator=g)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def against_reference(folder: str, steps: int, targets: tuple[str, ...]) -> dict:
    """`steps` AdamW steps of the sharded QLoRA model (each rank its slice of the global batch) and of the
    single-process reference (the whole batch): losses, the adapters' first gradients, their final values."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = setup(folder, targets=targets)
    adapters = {k: v for k, v in st.full_state_dict(model, rank0_only=False).items() if ".lora_" in k}
    ref = reference(folder, adapters, targets=targets)
    ref_params = dict(ref.named_parameters())
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    losses, ref_losses, grads, ref_grads = [], [], {}, {}
    for step in range(steps):
        tokens = _batch(step)
        loss = _loss(model, tokens[2 * rank : 2 * rank + 2])
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        ref_loss = _loss(ref, tokens)
        ref_loss.backward()
        ref_losses.append(ref_loss.item())
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in trainable.items()}
            ref_grads = {n: ref_params[n].grad.clone() for n in trainable}
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ref_optimizer.zero_grad(set_to_none=True)
    final = {k: v for k, v in st.full_state_dict(model, rank0_only=False).items() if ".lora_" in k}
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "grad_diff": max((grads[n] - ref_grads[n]).abs().max().item() for n in grads),
        "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
        "param_diff": max((final[n] - ref_params[n].detach()).abs().max().item() for n in final),
        "adapters": len(grads),
    }


def held_storage(folder: str) -> dict:
    """After a training step, per NF4 component: the rows this rank holds against the whole tensor's;
    the bytes of this rank's integer (packed weight, scales) shards against those of the whole tensors;
    and the bytes of their gathered buffers left allocated (none: a unit frees them after computing)."""
    model = setup(folder)
    _loss(model, _batch(0)[:2]).backward()
    rows, whole = {}, 0
    for h in held_params(model):
        if h.name.rpartition(".")[2] in COMPONENTS[:3]:
            rows[h.name] = (h.local.shape[0], h.shape[0])
        if not h.layout.dtype.is_floating_point:
            whole += math.prod(h.shape) * h.layout.dtype.itemsize
    packed = [b for u in runtime_of(model).units for b in u.buffers if not b.group.dtype.is_floating_point]
    return {
        "rows": rows,
        "held_bytes": sum(b.shard.untyped_storage().nbytes() for b in packed),
        "whole_bytes": whole,
        "gathered_bytes": sum(b._unsharded.untyped_storage().nbytes() for b in packed),
    }


def merged_export(folder: str, out: str) -> dict:
    """Train 2 steps, export merged (every rank), return the adapted model's logits (rank 0 compares)."""
    model = setup(folder, targets=("all-linear",))
    trainable = [p for p in model.parameters() if p.requires_grad]
    ranks.train(model, torch.optim.AdamW(trainable, lr=1e-2), None, 2, seed=5)
    st.save_pretrained(model, out, merge_lora=True)
    model.eval()
    return {"logits": ranks.logits(model)}


def random_init(folder: str) -> dict:
    """The public path without a checkpoint: peft's get_peft_model on meta, `st.quantize_base`, `st.shard`
    with the init it returns: the adapters as peft initialises them, the base drawn and quantised."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    with torch.device("meta"):
        model = get_peft_model(ranks.meta_model(folder), LoraConfig(r=4, target_modules=["q_proj"]))
    init = st.quantize_base(model)
    st.shard(model, wrap=ranks.blocks(model), param_init_fn=init)
    full = st.full_state_dict(model, rank0_only=False)
    codes = [v for k, v in full.items() if k.endswith("weight_nf4")]
    return {
        "b_zero": all(not v.any() for k, v in full.items() if ".lora_B." in k),
        "a_drawn": all(v.any() for k, v in full.items() if ".lora_A." in k),
        "codes": len(codes),
        "distinct_codes": min(len(v.unique()) for v in codes),
        "finite": bool(torch.isfinite(ranks.logits(model)).all()),
    }


def whole_checkpoint(folder: str, checkpoint: str) -> dict:
    """A checkpoint of everything (the packed base too, params='all'), loaded into a model whose base was
    drawn at random: the logits come back exactly."""
    model = setup(folder)
    expected = ranks.logits(model)
    st.save_checkpoint(checkpoint, {"model": model})
    torch.manual_seed(5)
    with torch.device("meta"):
        fresh = ranks.apply_lora(ranks.meta_model(folder), **LORA)
    st.shard(fresh, wrap=ranks.blocks(fresh), param_init_fn=st.quantize_base(fresh))
    before = ranks.logits(fresh)
    st.load_checkpoint(checkpoint, {"model": fresh})
    return {"exact": torch.equal(ranks.logits(fresh), expected), "differed": not torch.equal(before, expected)}
