"""Every torch.compile form on one GPU (inductor, bf16, world size 1), 6 steps each from the same weights.

    python tests/gpu/compile_forms.py                 # the built-in 1.5B cut to 8 layers, batch 2 x 4096
    python tests/gpu/compile_forms.py --size tiny --seq 64 --device cpu --backend aot_eager   # a dry run

Prints one row per form: the loss of every step and the largest difference from eager's; exits 1 if a
form differs from eager by more than --tolerance (2e-3: what torch FSDP2 compiled vs eager shows).
Run by tests/gpu/test_compile_gpu.py where CUDA is present.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

FORMS = (
    "eager",
    "block.compile() after",
    "compiled forward",
    "torch FSDP2 Block.compile()",
    "block.compile() before",
    "torch.compile(block)",
    "model.compile()",
    "eager, checkpointed",
    "block.compile() after, checkpointed",
    "eager, offloaded",
    "block.compile() after, offloaded",
)


@dataclass(frozen=True, kw_only=True)
class Setup:
    size: str
    layers: int
    batch: int
    seq: int
    steps: int
    device: str
    backend: str


def _compile(module, setup: Setup, **kwargs):
    return torch.compile(module, backend=setup.backend, **kwargs)


def _build(form: str, setup: Setup):
    """The model of `form` on `setup.device`, its optimizer, and the module to call for logits."""
    import shardtrain as st
    from shardtrain.bench.engines import make_optimizer
    from shardtrain.bench.same_weights import build_meta_model
    from shardtrain.models.llama import SHARD_UNITS, Block, llama_config

    device = torch.device(setup.device)
    named = build_meta_model(llama_config(setup.size, n_layers=setup.layers, max_seq_len=setup.seq))
    model = named.model
    precision = "bf16"
    if form.startswith("torch FSDP2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in [model.embed, *model.layers, model.head, model]:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        model.to_empty(device=device)
        named.init_all_(seed=0, device=device)
        if "compile" in form:
            for block in model.layers:
                block.compile(backend=setup.backend)
        return model, make_optimizer(model.parameters()), model
    if form in ("block.compile() before",):
        for block in model.layers:
            block.compile(backend=setup.backend)
    if form == "torch.compile(block)":
        for i, block in enumerate(model.layers):
            model.layers[i] = _compile(block, setup)
    st.shard(
        model,
        wrap=SHARD_UNITS,
        mixed_precision=precision,
        device=device,
        activation_checkpointing={Block} if "checkpointed" in form else None,
        cpu_offload=0.5 if "offloaded" in form else False,
        param_init_fn=named.param_init_fn(seed=0, device=device, allocate=False),
    )
    call: nn.Module = model
    if form.startswith("block.compile() after"):
        for block in model.layers:
            block.compile(backend=setup.backend)
    elif form == "compiled forward":
        for block in model.layers:
            block.forward = _compile(block.forward, setup, fullgraph=True)
    elif form == "model.compile()":
        model.compile(backend=setup.backend)
    return model, make_optimizer(model.parameters()), call


def run_form(form: str, setup: Setup) -> list[float]:
    torch._dynamo.reset()
    model, optimizer, call = _build(form, setup)
    generator = torch.Generator().manual_seed(1)
    vocab = model.cfg.vocab_size
    losses = []
    for _ in range(setup.steps):
        tokens = torch.randint(0, vocab, (setup.batch, setup.seq + 1), generator=generator).to(setup.device)
        logits = call(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    del model, optimizer, call
    if setup.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return losses


def run_all(setup: Setup, forms=FORMS) -> dict[str, list[float]]:
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29617")
        dist.init_process_group("nccl" if setup.device.startswith("cuda") else "gloo", rank=0, world_size=1)
    if setup.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(setup.device))
    results = {}
    for form in forms:
        results[form] = run_form(form, setup)
        print(f"{form:<40} " + ", ".join(f"{v:.4f}" for v in results[form]), flush=True)
    return results


def differences(results: dict[str, list[float]]) -> dict[str, float]:
    """Each form's largest per-step difference from its eager reference (eager, checkpointed or offloaded)."""
    out = {}
    for form, losses in results.items():
        ref = (
            "eager, checkpointed" if "checkpointed" in form else "eager, offloaded" if "offloaded" in form else "eager"
        )
        if ref in results and form != ref:
            out[form] = max(abs(a - b) for a, b in zip(losses, results[ref]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.5b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--tolerance", type=float, default=2e-3)
    parser.add_argument("--forms", default=";".join(FORMS), help="a subset of the forms, separated by ;")
    args = parser.parse_args()
    setup = Setup(
        size=args.size,
        layers=args.layers,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        device=args.device,
        backend=args.backend,
    )
    results = run_all(setup, [f for f in FORMS if f in args.forms.split(";")])
    worst = differences(results)
    print("\n| form | per-step loss | max |Δ| vs eager |\n|---|---|---|")
    for form, losses in results.items():
        delta = f"{worst[form]:.1e}" if form in worst else "—"
        print(f"| {form} | {', '.join(f'{v:.4f}' for v in losses)} | {delta} |")
    bad = {f: d for f, d in worst.items() if d > args.tolerance}
    if bad:
        print(f"differ from eager by more than {args.tolerance}: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
