"""Rank-side code of the torch.compile tests: every form users write, trained beside eager.

Each form trains a sharded built-in Llama for a few steps from the same weights and data as an eager
sharded copy; the losses and the final weights must agree. `backend` is "aot_eager" by default
(dynamo and AOTAutograd trace the forms exactly as with inductor, but the kernels are eager's, so
fp32 results are bit-comparable and a CPU compiles in seconds).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch._dynamo.utils import counters

import shardtrain as st
from shardtrain.models.llama import SHARD_UNITS, Block, Llama, llama_config

FORMS = (
    "torch.compile(block)",
    "block.compile() before",
    "block.compile() after",
    "compiled forward",
    "torch.compile(model)",
    "model.compile()",
)


def device() -> torch.device:
    """Where a rank computes: its GPU under NCCL (tests/gpu/nccl_parity.py), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _llama() -> Llama:
    return Llama(llama_config("tiny", n_layers=3))


def _apply(model: Llama, form: str, *, backend, when: str) -> nn.Module:
    """Apply `form` at `when` ("before" or "after" st.shard); return the module to call for logits."""
    if form == "torch.compile(block)" and when == "before":
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=backend)  # the OptimizedModule goes back in its parent
    elif form == "block.compile() before" and when == "before":
        for block in model.layers:
            block.compile(backend=backend)
    elif form == "block.compile() after" and when == "after":
        for block in model.layers:
            block.compile(backend=backend)
    elif form == "compiled forward" and when == "after":
        for block in model.layers:
            block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)  # no graph break inside
    elif form == "torch.compile(model)" and when == "after":
        return torch.compile(model, backend=backend)
    elif form == "model.compile()" and when == "after":
        model.compile(backend=backend)
    return model


def train_form(
    form: str,
    strategy: str,
    *,
    precision: str | None = None,
    ac: bool = False,
    backend: str = "aot_eager",
    steps: int = 3,
) -> dict:
    """Train `form` and eager side by side; return the worst differences and dynamo's counts."""
    torch._dynamo.reset()
    counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = _llama()
    results = {}
    counter = CompileCounterWithBackend(backend)
    for kind in ("eager", form):
        model = copy.deepcopy(plain)
        call: nn.Module = model
        if kind != "eager":
            call = _apply(model, form, backend=counter, when="before")
        st.shard(
            model,
            strategy=strategy,
            wrap=SHARD_UNITS,
            mixed_precision=precision,
            activation_checkpointing={Block} if ac else None,
        )
        if kind != "eager":
            call = _apply(model, form, backend=counter, when="after")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
        generator = torch.Generator().manual_seed(11)
        losses = []
        for _ in range(steps):
            tokens = torch.randint(0, 256, (2 * world, 17), generator=generator)[2 * rank : 2 * rank + 2].to(device())
            logits = call(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        results[kind] = (losses, st.full_state_dict(model, rank0_only=False))
    (eager_losses, eager_weights), (losses, weights) = results["eager"], results[form]
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, eager_losses)),
        "weights": max((weights[k] - v).abs().max().item() for k, v in eager_weights.items()),
        "breaks": sum(counters["graph_break"].values()),
        "frames": counter.frame_count,
    }


def recompiles_per_length() -> dict:
    """Compiled blocks over three sequence lengths: the forward compiles once, then once more with the
    sequence dimension dynamic, and never again."""
    torch._dynamo.reset()
    counter = CompileCounter()
    torch.manual_seed(0)
    model = st.shard(_llama(), wrap=SHARD_UNITS)
    for block in model.layers:
        block.forward = torch.compile(block.forward, backend=counter, fullgraph=True)
    frames = []
    for length in (16, 12, 8, 14):
        tokens = torch.randint(0, 256, (2, length + 1))
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        frames.append(counter.frame_count)
    return {"frames": frames, "blocks": len(model.layers)}
