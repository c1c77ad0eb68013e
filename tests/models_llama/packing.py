"""Packed rows for the packing tests (here and tests/train/test_packed.py), and their rank-side
code (run inside the Gloo pools).

A packed row holds documents back to back with `position_ids` restarting at 0 at each; the
reference runs every document alone, as a batch of one unpacked row.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardtrain as st
from shardtrain.models.llama import SHARD_UNITS, Block, Llama, llama_config
from shardtrain.train.packed import forward_logits
from tests.pretrained.hf_models import config

# Each row's document lengths; row 1 ends in a document of one token.
LENGTHS = ((5, 9, 2), (7, 8, 1))
VOCAB = 256  # token ids drawn below every test model's vocabulary


def tiny_hf_llama(attn_implementation: str = "sdpa") -> nn.Module:
    """transformers' LlamaForCausalLM at a test size (grouped-query attention, untied head)."""
    import transformers

    return transformers.LlamaForCausalLM._from_config(config("llama_untied"), attn_implementation=attn_implementation)


def _sharded(kind: str, model: nn.Module, *, ac: bool) -> nn.Module:
    """`model` under st.shard, every block a unit (and checkpointed if `ac`)."""
    if kind == "llama":
        return st.shard(model, wrap=SHARD_UNITS, activation_checkpointing={Block} if ac else None)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return st.shard(model, wrap={LlamaDecoderLayer}, activation_checkpointing={LlamaDecoderLayer} if ac else None)


def packed_rows(
    lengths: tuple[tuple[int, ...], ...], *, vocab: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """(input_ids, position_ids, each row's documents): rows of equal length, documents of random tokens."""
    generator = torch.Generator().manual_seed(seed)
    docs = [[torch.randint(0, vocab, (n,), generator=generator) for n in row] for row in lengths]
    ids = torch.stack([torch.cat(row) for row in docs])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    return ids, positions, docs


def spans(row: list[torch.Tensor]) -> list[slice]:
    """Where each document of `row` lies in the packed row."""
    out, start = [], 0
    for doc in row:
        out.append(slice(start, start + len(doc)))
        start += len(doc)
    return out


def packed_loss(logits: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy within documents: a target that starts a new document is skipped."""
    targets = ids[:, 1:].masked_fill(positions[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def alone_loss(model: nn.Module, docs: list[torch.Tensor]) -> torch.Tensor:
    """The same loss with every document run alone (summed over documents, divided by all targets)."""
    total, count = 0.0, 0
    for doc in docs:
        if len(doc) > 1:
            logits = forward_logits(model, doc[None], position_ids=None)
            total = total + F.cross_entropy(logits[0, :-1].float(), doc[1:], reduction="sum")
            count += len(doc) - 1
    return total / count


def worst_document_error(model: nn.Module, ids, positions, docs) -> float:
    """The largest difference between a packed document's logits and the document run alone."""
    logits = forward_logits(model, ids, position_ids=positions)
    worst = 0.0
    for r, row in enumerate(docs):
        for doc, span in zip(row, spans(row)):
            alone = forward_logits(model, doc[None], position_ids=None)[0]
            worst = max(worst, (logits[r, span] - alone).abs().max().item())
    return worst


def _on(device: torch.device, rows):
    ids, positions, docs = rows
    return ids.to(device), positions.to(device), [[d.to(device) for d in row] for row in docs]


def sharded_packed_training(kind: str, *, compiled: bool = False, ac: bool = True, steps: int = 2) -> dict:
    """Train a sharded model (`kind`: "llama", the built-in one, or "hf", transformers' Llama;
    activation checkpointing on every block if `ac`; compiled blocks if `compiled`) on packed rows
    beside an unsharded reference that runs every document alone; return the differences of the
    losses (each step's, and the worst) and the worst of the final weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    reference = Llama(llama_config("tiny", n_layers=2)) if kind == "llama" else tiny_hf_llama()
    reference = reference.to(device)
    model = _sharded(kind, copy.deepcopy(reference), ac=ac)
    if compiled:  # aot_eager on the CPU (eager's kernels, compiled in seconds), inductor on CUDA
        st.compile_blocks(model, backend="inductor" if device.type == "cuda" else "aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        batches = [_on(device, packed_rows(LENGTHS, vocab=VOCAB, seed=100 * step + r)) for r in range(world)]
        ids, positions, _ = batches[rank]
        loss = packed_loss(forward_logits(model, ids, position_ids=positions), ids, positions)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the engine averages the ranks' gradients: the reference takes the mean of the ranks' losses
        ref_losses = [alone_loss(reference, [d for row in docs for d in row]) for _, _, docs in batches]
        (sum(ref_losses) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        losses.append(abs(loss.item() - ref_losses[rank].item()))
    weights = st.full_state_dict(model, rank0_only=False)
    worst_weight = max((weights[k] - v.cpu()).abs().max().item() for k, v in reference.state_dict().items())
    return {"loss": max(losses), "losses": losses, "weights": worst_weight}
