"""Rank-side checks of what the optimizer sees after st.shard: shapes, names, dtypes, frozen parameters.

Run inside the Gloo pools (tests/core/test_param_shapes.py).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import shardtrain as st
from shardtrain.core.collectives import Collective, observe
from shardtrain.core.shard_module import runtime_of
from shardtrain.models.llama import SHARD_UNITS, Block
from tests.models import split_llama, tiny_llama


def hf_llama(*, tie: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config)


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4))


def _wrap(kind: str):
    if kind == "llama":
        return SHARD_UNITS
    if kind == "tied_llama":
        return {Block}
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {LlamaDecoderLayer} if kind.startswith("hf_llama") else {GPT2Block}


def device() -> torch.device:
    """Where a rank computes: its GPU under NCCL (tests/gpu/nccl_parity.py), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


BUILDERS = {
    "llama": split_llama,
    "tied_llama": tiny_llama,
    "hf_llama": hf_llama,
    "hf_llama_tied": lambda: hf_llama(tie=True),
    "hf_gpt2": hf_gpt2,
}


def optimizer_view(kind: str, strategy: str) -> dict:
    """Compare every parameter the sharded model yields with the unsharded original."""
    torch.manual_seed(0)
    plain = BUILDERS[kind]()
    before = [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in plain.named_parameters()]
    count = sum(p.numel() for p in plain.parameters())
    model = st.shard(copy.deepcopy(plain), strategy=strategy, wrap=_wrap(kind))
    after = list(model.named_parameters())
    world, rank = dist.get_world_size(), dist.get_rank()
    problems = []
    for (name, shape, dtype, grad), (new_name, p) in zip(before, after):
        if name != new_name or tuple(p.shape) != shape or p.dim() != len(shape) or p.ndim != len(shape):
            problems.append(f"{name}: {new_name} {tuple(p.shape)} dim {p.dim()} vs {shape}")
        if p.dtype != dtype or p.requires_grad != grad or tuple(p.shape[1:]) != shape[1:]:
            problems.append(f"{name}: dtype/requires_grad/trailing {p.dtype} {p.requires_grad} {p.shape[1:]}")
        if strategy != "no_shard":
            if not isinstance(p, DTensor):
                problems.append(f"{name}: {type(p).__name__}, not a DTensor")
                continue
            rows = shape[0] if shape else 1
            per = math.ceil(rows / world)
            expected = max(0, min(rows, (rank + 1) * per) - rank * per) if shape else None
            if shape and p.to_local().shape[0] != expected:
                problems.append(f"{name}: {p.to_local().shape[0]} local rows, expected {expected}")
    full = st.full_state_dict(model, rank0_only=False)
    states = model.state_dict()
    mismatched = [k for k, v in states.items() if isinstance(v, DTensor) and not torch.equal(v.full_tensor(), full[k])]
    return {
        "problems": problems,
        "count": sum(p.numel() for p in model.parameters()) == count,
        "names": [n for n, _ in after] == [n for n, *_ in before],
        "state_dict_global": all(tuple(v.shape) == tuple(full[k].shape) for k, v in states.items()),
        "full_tensor_equal": not mismatched,
    }


def _lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def lora_training(strategy: str) -> dict:
    """PEFT LoRA on a small LlamaForCausalLM: parity with one process, gradient memory, reduced elements."""
    from peft import LoraConfig, get_peft_model
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    base = hf_llama().to(device())
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    with torch.no_grad():  # B starts at zero; give it values so that A's gradient is not zero either
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    reference = copy.deepcopy(peft_model)
    model = st.shard(peft_model, strategy=strategy, wrap={LlamaDecoderLayer})
    world, rank = dist.get_world_size(), dist.get_rank()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(7)
    reduced, losses, ref_losses = [], [], []

    def count(c: Collective) -> None:  # gradient traffic (not the integer agreement on which parameters were used)
        gradients = c.kind in ("reduce_scatter", "all_to_all") or (c.kind == "all_reduce" and strategy == "no_shard")
        if gradients and c.dtype.is_floating_point:
            reduced[-1] += c.numel

    for _ in range(3):
        tokens = torch.randint(0, 96, (2 * world, 9), generator=generator).to(device())
        reduced.append(0)
        with observe(count):
            loss = _lm_loss(model, tokens[2 * rank : 2 * rank + 2])
            loss.backward()
        grad_bytes = sum(
            buf.grad.numel() * buf.grad.element_size()
            for unit in runtime_of(model).units
            for buf in unit.buffers
            if buf.grad is not None
        )
        frozen_none = all(p.grad is None for p in model.parameters() if not p.requires_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        ref_loss = sum(_lm_loss(reference, tokens[2 * r : 2 * r + 2]) for r in range(world)) / world
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(ref_loss.item())
    full = st.full_state_dict(model, rank0_only=False)
    expected = reference.state_dict()
    worst = max((full[k].to(v.device) - v).abs().max().item() for k, v in expected.items())  # full: on the CPU
    trainable_numel = sum(p.numel() for p in trainable)
    padded = (
        sum(math.ceil(p.shape[0] / world) * world * math.prod(p.shape[1:]) for p in trainable)
        if strategy != "no_shard"
        else trainable_numel
    )
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "worst": worst,
        "grad_bytes": grad_bytes,
        "trainable_bytes": trainable_numel * 4,
        "world": world,
        "padded_numel": padded,
        "reduced_per_step": reduced,
        "frozen_none": frozen_none,
        "total_numel": sum(p.numel() for p in model.parameters()),
    }


class MixedUnit(nn.Module):
    """One unit holding a frozen bf16 base, a trainable fp32 adapter and an fp32 norm."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(12, 10).to(torch.bfloat16).requires_grad_(False)
        self.adapter = nn.Linear(12, 10, bias=False)
        self.norm = nn.LayerNorm(10)
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base(x.to(torch.bfloat16)).float() + self.adapter(x)
        return self.head(torch.tanh(self.norm(h)))


def mixed_dtype_training(strategy: str) -> dict:
    """A unit that mixes dtypes trains like one process; its frozen bf16 base keeps its dtype."""
    torch.manual_seed(0)
    plain = MixedUnit().to(device())
    model = st.shard(copy.deepcopy(plain), strategy=strategy)
    world, rank = dist.get_world_size(), dist.get_rank()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(3)
    worst_loss = 0.0
    for _ in range(4):
        x = torch.randn(2 * world, 12, generator=generator).to(device())
        y = torch.randint(0, 3, (2 * world,), generator=generator).to(device())
        loss = F.cross_entropy(model(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref = sum(F.cross_entropy(plain(x[2 * r : 2 * r + 2]), y[2 * r : 2 * r + 2]) for r in range(world)) / world
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        gathered = [torch.zeros((), device=device()) for _ in range(world)]
        dist.all_gather(gathered, loss.detach())
        worst_loss = max(worst_loss, abs(sum(g.item() for g in gathered) / world - ref.item()))
    full = st.full_state_dict(model, rank0_only=False)
    worst = max((full[k].to(v.device).float() - v.float()).abs().max().item() for k, v in plain.state_dict().items())
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    return {
        "worst": worst,
        "worst_loss": worst_loss,
        "base_dtype": dtypes["base.weight"],
        "adapter_dtype": dtypes["adapter.weight"],
        "groups": len(runtime_of(model).units[0].buffers),
    }


def optimizer_built_before_shard() -> dict:
    """An optimizer built over the parameters before st.shard is re-pointed at its first step."""
    torch.manual_seed(0)
    plain = tiny_llama()
    model = copy.deepcopy(plain)
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    st.shard(model, wrap={Block})
    late = torch.optim.SGD(copy.deepcopy(plain).parameters(), lr=0.1)  # a foreign optimizer is left alone
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    before = {k: v.clone() for k, v in st.full_state_dict(model, rank0_only=False).items()}
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    early.step()
    after = st.full_state_dict(model, rank0_only=False)
    changed = sum(not torch.equal(before[k], after[k]) for k in before)
    owned = {id(p) for p in model.parameters()}
    late.step()
    return {
        "changed": changed,
        "total": len(before),
        "rebound": all(id(p) in owned for g in early.param_groups for p in g["params"]),
        "foreign_untouched": not any(id(p) in owned for g in late.param_groups for p in g["params"]),
    }
