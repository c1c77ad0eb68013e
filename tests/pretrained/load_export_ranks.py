"""Rank-side code of the pretrained-loading tests (run on every rank of a `pools(n)` process group)."""

from __future__ import annotations

import gc
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import shardtrain as st
from shardtrain.core.shard_module import runtime_of
from shardtrain.policy import classes_named
from shardtrain.pretrained.lora import adapter_init, apply_lora
from shardtrain.pretrained.qlora import quantize_base
from shardtrain.train.schedule import make_scheduler
from tests.pretrained.hf_models import VOCAB

TOKENS = torch.Generator().manual_seed(7)
INPUT = torch.randint(0, VOCAB, (2, 12), generator=TOKENS)


def meta_model(folder: str | Path) -> nn.Module:
    """The model of `folder`, built from its config.json on the meta device (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)


def blocks(model: nn.Module) -> frozenset:
    return classes_named(model, model._no_split_modules, what="_no_split_modules")


def sharded(
    folder,
    strategy: str,
    *,
    mesh=None,
    lora: dict | None = None,
    seed: int = 0,
    embedding_unit: bool = False,
    base_bits: int = 16,
) -> nn.Module:
    """`folder`'s model on meta (with LoRA adapters when `lora` is given, over a 4-bit base with
    `base_bits=4`), sharded, weights loaded. `embedding_unit`: the embedding is a unit of its own
    (sharded, it looks rows up where they are held)."""
    torch.manual_seed(seed)
    model = meta_model(folder)
    wrap = blocks(model) | ({nn.Embedding} if embedding_unit else set())
    init = None
    if lora is not None:
        model = apply_lora(model, **lora)
        init = adapter_init(model)
    init = quantize_base(model, bits=base_bits, param_init_fn=init)
    st.shard(model, strategy=strategy, wrap=wrap, mesh=mesh, param_init_fn=init)
    st.load_pretrained(model, folder)
    return model


def reference(folder) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT).logits


def compare_with_from_pretrained(
    folder: str, strategies: list[str], mesh=None, embedding_unit: bool = False
) -> dict[str, dict]:
    """Per strategy: the largest logit difference from `from_pretrained`'s model, whether every parameter
    and buffer (non-persistent rotary tables included) equals its own, and the rows of each tensor this
    rank read from the files beside the rows it holds."""
    from shardtrain.pretrained import load

    reads: dict[str, tuple[int, int]] = {}
    read_box = load._read_box

    def recording(handles, entry, box):
        assert box.cols is None, "no tensor parallelism here: whole rows"
        reads[entry.key] = box.rows if entry.shape else (0, 1)
        return read_box(handles, entry, box)

    load._read_box = recording
    try:
        return _compare(folder, strategies, mesh, reads, embedding_unit)
    finally:
        load._read_box = read_box


def _compare(folder, strategies, mesh, reads, embedding_unit) -> dict[str, dict]:
    ref = reference(folder)
    expected = logits(ref)
    ref_state = {**dict(ref.named_parameters(remove_duplicate=False)), **dict(ref.named_buffers())}
    out = {}
    for strategy in strategies:
        reads.clear()
        model = sharded(folder, strategy, mesh=mesh, embedding_unit=embedding_unit).eval()
        diff = (logits(model) - expected).abs().max().item()
        full = st.full_state_dict(model, rank0_only=False)
        buffers = dict(model.named_buffers())
        same = (
            all(torch.equal(full[k], ref_state[k]) for k in full)
            and set(full) == set(ref.state_dict())
            and all(torch.equal(buffers[k], ref_state[k]) for k in buffers)
        )
        runtime = runtime_of(model)
        held = {
            s.fqn: s.held_rows(runtime.comm.shard_rank if s.world > 1 else 0)
            for u in runtime.units
            for s in u.layout.params
        }
        held = {k: v for k, v in held.items() if v[1] > v[0]}
        out[strategy] = {"diff": diff, "same": same, "held": held, "read": dict(reads)}
        del model
    return out


def train(model: nn.Module, optimizer, scheduler, steps: int, *, seed: int) -> list[float]:
    """`steps` optimizer steps on random tokens (every rank its own slice of one global batch)."""
    g = torch.Generator().manual_seed(seed)
    rank, world, losses = dist.get_rank(), dist.get_world_size(), []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (2 * world, 13), generator=g)[2 * rank : 2 * rank + 2]
        out = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def export_after_training(folder: str, out: str, strategy: str, max_shard_size: str) -> dict[str, torch.Tensor]:
    """Load, train 2 steps, export with `st.save_pretrained` and, beside it, with the model's own
    (installed) `save_pretrained` in bf16; return the full state dict (rank 0)."""
    model = sharded(folder, strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, None, 2, seed=3)
    st.save_pretrained(model, out, max_shard_size=max_shard_size)
    model.save_pretrained(out + "-method")
    st.save_pretrained(model, out + "-bf16", dtype=torch.bfloat16)
    try:
        model.save_pretrained(out + "-refused", push_to_hub=True)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return {"state": st.full_state_dict(model), "refused": refused}


LORA = {"rank": 8, "alpha": 16.0, "targets": ("q_proj", "v_proj"), "dropout": 0.1}


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's rows of every trainable parameter (what an adapter-only checkpoint must keep)."""
    runtime = runtime_of(model)
    return {s.fqn: u.held(i).clone() for u in runtime.units for i, s in enumerate(u.layout.params) if s.requires_grad}


def lora_setup(
    folder: str, strategy: str, *, seed: int, targets: tuple[str, ...] = LORA["targets"], base_bits: int = 16
):
    model = sharded(folder, strategy, lora={**LORA, "targets": targets}, seed=seed, base_bits=base_bits)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)
    scheduler = make_scheduler(optimizer, warmup_steps=2, total_steps=6, min_ratio=0.1)
    return model, optimizer, scheduler


def lora_initial(folder: str, strategy: str) -> dict:
    """The adapters as peft initialises them, the adapted model's logits against the base's, and after
    one step: which parameters the optimizer holds and which have gradients (and their storage)."""
    model, optimizer, scheduler = lora_setup(folder, strategy, seed=0)
    state = st.full_state_dict(model, rank0_only=False)
    a = [v for k, v in state.items() if ".lora_A." in k]
    b = [v for k, v in state.items() if ".lora_B." in k]
    bound = 1 / math.sqrt(a[0].shape[1])  # kaiming_uniform(a=sqrt(5)) over fan_in columns
    model.eval()
    diff = (logits(model) - logits(reference(folder))).abs().max().item()
    model.train()
    train(model, optimizer, scheduler, 1, seed=1)
    runtime = runtime_of(model)
    trainable_rows = sum(
        u.held(i).numel() for u in runtime.units for i, s in enumerate(u.layout.params) if s.requires_grad
    )
    return {
        "b_zero": all(torch.count_nonzero(t) == 0 for t in b),
        "a_count": len(a),
        "a_within": all(0 < t.abs().max() <= bound for t in a),
        "diff": diff,
        "optimizer": sum(len(g["params"]) for g in optimizer.param_groups),
        "trainable": sum(1 for p in model.parameters() if p.requires_grad),
        "frozen_with_grad": [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None],
        "grad_storage": sum(buf.group.grad_numel for u in runtime.units for buf in u.buffers),
        "trainable_rows": trainable_rows,
    }


def lora_resume(folder: str, checkpoint: str, strategy: str, base_bits: int = 16) -> dict:
    """6 steps straight vs 3 + adapter-only save + a fresh model (base reloaded) + load + 3, on every rank."""
    model, optimizer, scheduler = lora_setup(folder, strategy, seed=0, base_bits=base_bits)
    straight = train(model, optimizer, scheduler, 3, seed=11)
    st.save_checkpoint(checkpoint, {"model": model, "optimizer": optimizer, "scheduler": scheduler}, params="trainable")
    straight += train(model, optimizer, scheduler, 3, seed=12)
    expected = lora_state(model)
    del model, optimizer, scheduler
    gc.collect()
    model, optimizer, scheduler = lora_setup(folder, strategy, seed=99, base_bits=base_bits)  # other adapters
    try:
        st.load_checkpoint(checkpoint, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
        refused = None
    except ValueError as exc:
        refused = str(exc)
    st.load_checkpoint(checkpoint, {"model": model, "optimizer": optimizer, "scheduler": scheduler}, params="trainable")
    resumed = train(model, optimizer, scheduler, 3, seed=12)
    got = lora_state(model)
    return {
        "straight": straight[3:],
        "resumed": resumed,
        "refused": refused,
        "exact": set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in got),
        "rows": {k: tuple(v.shape) for k, v in got.items()},
    }


def lora_export(
    folder: str, merged: str, adapter: str, strategy: str, targets: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """Train LoRA 2 steps; export merged and as an adapter; return the full peft state (rank 0)."""
    model, optimizer, scheduler = lora_setup(folder, strategy, seed=0, targets=targets)
    train(model, optimizer, scheduler, 2, seed=5)
    st.save_pretrained(model, merged, merge_lora=True)
    model.save_pretrained(adapter)
    return st.full_state_dict(model)


def load_message(path: str, folder: str, strict: bool = True) -> str | None:
    """The error `st.load_pretrained(<folder's model>, path)` raises on this rank (None: it loaded)."""
    model = meta_model(folder)
    st.shard(model, wrap=blocks(model))
    try:
        st.load_pretrained(model, path, strict=strict)
    except ValueError as exc:
        return str(exc)
    return None


def peak_load_memory(folder: str) -> dict[str, int]:
    """Host memory of building + sharding, then of loading, `folder`'s model: each phase's peak resident
    size (Linux VmHWM, reset before it) above the resident size before the model existed, this rank's
    shard bytes and the largest tensor's bytes."""
    meta_model(folder)  # imports the model's code, so that it does not count
    gc.collect()
    start = _status("VmRSS")
    _reset_peak()
    model = meta_model(folder)
    st.shard(model, wrap=blocks(model) | {nn.Embedding})
    shard_peak = _status("VmHWM") - start
    _reset_peak()
    st.load_pretrained(model, folder)
    load_peak = _status("VmHWM") - start
    units = runtime_of(model).units
    shard_bytes = sum(u.layout.shard_bytes() for u in units)
    largest = max(s.numel * s.dtype.itemsize for u in units for s in u.layout.params)
    return {"shard_peak": shard_peak, "load_peak": load_peak, "shard": shard_bytes, "largest": largest}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size (VmHWM) restarts from the current one


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)
