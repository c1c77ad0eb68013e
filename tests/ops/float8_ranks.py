"""Rank-side code of the float8 checkpoint test (run on every rank of a `pools(2)` process group): a Llama
with Linears large enough to convert, trained a step with float8 and without, saved and loaded across."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch
from safetensors import safe_open

import shardtrain as st
from shardtrain.models.llama import SHARD_UNITS, Llama, LlamaConfig
from shardtrain.ops.float8 import convert_to_float8

# dim 1024 and ffn 1040: the feed-forward's w1 and w3 (1024 -> 1040) convert, nothing else (ops/float8.py)
CONFIG = LlamaConfig(vocab_size=256, dim=1024, n_layers=1, n_heads=8, n_kv_heads=4, ffn_dim=1040, max_seq_len=16)


def build(*, float8: bool, seed: int):
    torch.manual_seed(seed)
    model = Llama(CONFIG)
    converted = convert_to_float8(model) if float8 else []
    model = st.shard(model, wrap=SHARD_UNITS)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), converted


def step(model, optimizer) -> float:
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def file_dtypes(path: str) -> set[str]:
    """The dtypes of every tensor in the checkpoint's safetensors files."""
    dtypes = set()
    for file in Path(path).rglob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            dtypes |= {f.get_slice(name).get_dtype() for name in f.keys()}
    return dtypes


def round_trip(root: str) -> dict:
    """float8 step -> save -> load into a plain model (values equal) -> plain step -> save -> load into
    a float8 model (values equal)."""
    f8, f8_opt, converted = build(float8=True, seed=0)
    step(f8, f8_opt)
    st.save_checkpoint(f"{root}/from_float8", {"model": f8, "optimizer": f8_opt})
    plain, plain_opt, _ = build(float8=False, seed=1)
    st.load_checkpoint(f"{root}/from_float8", {"model": plain, "optimizer": plain_opt})
    into_plain = _same(st.full_state_dict(f8), st.full_state_dict(plain))
    step(plain, plain_opt)
    st.save_checkpoint(f"{root}/from_plain", {"model": plain, "optimizer": plain_opt})
    back, back_opt, _ = build(float8=True, seed=2)
    st.load_checkpoint(f"{root}/from_plain", {"model": back, "optimizer": back_opt})
    into_float8 = _same(st.full_state_dict(plain), st.full_state_dict(back))
    float8_types = sorted({type(m).__name__ for m in back.modules() if "Float8" in type(m).__name__})
    return {
        "converted": converted,
        "into_plain": into_plain,
        "into_float8": into_float8,
        "dtypes": sorted(file_dtypes(f"{root}/from_float8")),
        "float8_types": float8_types,
        "loss_after": step(back, back_opt),
    }


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def through_the_engine() -> dict:
    """Engine(float8=True, compile=True).setup on a meta-built model with its optimizer built before: the
    Linears converted before sharding, the optimizer rebound (the blocks compile at their first forward,
    which this does not run)."""
    engine = st.Engine(accelerator="cpu", float8=True, compile=True)
    engine.launch()
    with engine.init_module(empty_init=True):
        model = Llama(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model, optimizer = engine.setup(model, optimizer)
    float8 = [n for n, m in model.named_modules() if "Float8" in type(m).__name__]
    return {"float8": float8, "printed": printed.getvalue(), "rebound": len(optimizer.param_groups[0]["params"])}
