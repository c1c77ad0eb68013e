"""Rank-side code of the parity tests: the engine against a single-process reference.

The reference replays every rank's micro-batches one by one on an unsharded copy, accumulating
each rank's gradient in fp32 and averaging over ranks, exactly what data parallelism computes.
With mixed precision it runs a low-precision copy of the weights, emulating the engine's casts
instead of loosening tolerances. BatchNorm statistics are kept per rank, as each rank keeps its own.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import shardtrain as st
from shardtrain.models.llama import Block
from shardtrain.options import GatherMode, resolve_options
from tests import foreign_models
from tests.models import MODELS, lm_loss, make_batches

FP32_TOL = dict(rtol=1.3e-6, atol=1e-5)
# Note: on CUDA, cuBLAS picks bf16/fp16 kernels by pointer alignment, and a view into a flat buffer
# is aligned differently from a standalone tensor, so low-precision GEMMs may round differently
# there; the CPU runs the emulated casts bit for bit and keeps FP32_TOL. Such a flip can turn the
# sign of a near-zero gradient, and AdamW then moves that weight by up to its step size (lr 1e-2):
# atol is half of that.
LOW_PRECISION_CUDA_TOL = dict(rtol=1e-2, atol=5e-3)


@dataclass(frozen=True)
class Case:
    strategy: str = "full_shard"
    optim: str = "adamw"
    ac: bool = False
    accum: str = "none"  # "none" | "no_sync" | "plain": two micro-batches per step
    precision: str | None = None
    clip: float | None = None
    steps: int = 10
    mesh: tuple[int, int] | None = None
    offload: bool | float | st.CPUOffload = False  # a float: partial offload of that share of the parameters

    @property
    def micro(self) -> int:
        return 1 if self.accum == "none" else 2


def wrap_policy(kind: str):
    if kind == "cnn":
        return st.SizePolicy(min_params=150)
    if kind in foreign_models.FACTORIES:
        return foreign_models.block_classes(kind)
    return MODELS[kind][1]


def factory(kind: str):
    return foreign_models.FACTORIES.get(kind) or MODELS[kind][0]


def ac_policy(kind: str):
    if kind in foreign_models.FACTORIES:
        return foreign_models.block_classes(kind)
    return {"llama": MODELS["llama"][1], "split_llama": {Block}, "frozen": MODELS["frozen"][1]}.get(
        kind, lambda m: isinstance(m, nn.Linear)
    )


def nanogpt_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight-decay groups as nanoGPT's `configure_optimizers` chooses them: by `p.dim() >= 2`."""
    param_dict = {pn: p for pn, p in model.named_parameters() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    return [{"params": decay_params, "weight_decay": weight_decay}, {"params": nodecay_params, "weight_decay": 0.0}]


def timm_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """As timm's `param_groups_weight_decay`: no decay for `param.ndim <= 1` or a name ending in `.bias`."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim <= 1 or name.endswith(".bias") else decay).append(param)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    """The optimizer of a parity case; its groups are chosen by shape, as user code does (the sharded
    model must present every parameter with its original shape for the groups to agree)."""
    groups = timm_groups(model, 0.1) if name == "adam_foreach" else nanogpt_groups(model, 0.1)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    # Note: eps 1e-6 (not 1e-8) keeps Adam from amplifying the last-bit differences of a reduction
    # order into visible updates where a gradient cancels to almost nothing.
    if name == "adamw_fused":
        return torch.optim.AdamW(groups, lr=1e-2, eps=1e-6, fused=True)
    if name == "adam_foreach":
        return torch.optim.Adam(groups, lr=1e-2, eps=1e-6, foreach=True)
    return torch.optim.AdamW(groups, lr=1e-2, eps=1e-6, foreach=False)


def _chunk(batch, rank: int, micro: int, index: int, per: int):
    start = (rank * micro + index) * per
    return tuple(t[start : start + per] for t in batch)


class Reference:
    def __init__(self, model: nn.Module, case: Case, world: int) -> None:
        self.model, self.case, self.world = model, case, world
        self.opt = make_optimizer(model, case.optim)
        self.buffers = [copy.deepcopy(dict(model.named_buffers())) for _ in range(world)]
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case.precision)

    def _runner(self) -> nn.Module:
        if self.dtype is None:
            return self.model
        low = copy.deepcopy(self.model)
        for p in low.parameters():
            p.data = p.data.to(self.dtype)
        return low

    def step(self, batch, per: int) -> list[torch.Tensor]:
        net, case = self._runner(), self.case
        params = [p for p in net.parameters()]
        total = [None] * len(params)
        losses = []
        for r in range(self.world):
            _load_buffers(net, self.buffers[r])
            rank_grad = [None] * len(params)
            rank_loss = 0.0
            for m in range(case.micro):
                x, y = _chunk(batch, r, case.micro, m, per)
                if self.dtype is not None and x.is_floating_point():
                    x = x.to(self.dtype)
                net.zero_grad(set_to_none=True)
                loss = lm_loss(net, (x, y)) / case.micro
                loss.backward()
                rank_loss += loss.detach()
                for i, p in enumerate(params):
                    if p.grad is not None:
                        g = p.grad.float()
                        rank_grad[i] = g if rank_grad[i] is None else rank_grad[i] + g
            self.buffers[r] = copy.deepcopy(dict(net.named_buffers()))
            losses.append(rank_loss)
            for i, g in enumerate(rank_grad):
                if g is not None:
                    total[i] = g if total[i] is None else total[i] + g
        for p, g in zip(self.model.parameters(), total):
            p.grad = None if g is None else g / self.world
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], case.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return losses


def _load_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


@dataclass(frozen=True)
class ReferenceRun:
    """What the reference computed for a case: per step, every rank's loss; at the end, its weights and
    every rank's buffers."""

    losses: list[list[torch.Tensor]]
    state: dict[str, torch.Tensor]
    buffers: list[dict[str, torch.Tensor]]


_REFERENCES: dict[tuple, ReferenceRun] = {}  # per pool process: the matrix repeats each reference


def reference_run(kind: str, case: Case, *, world: int, per: int, device: torch.device) -> ReferenceRun:
    """The reference's run for `case`, computed once per process for every case that shares what the
    reference reads (model, optimizer, micro-batches, clipping, precision, steps, world): the strategy,
    activation checkpointing, mesh and offload change only the sharded side."""
    key = (kind, case.optim, case.micro, case.clip, case.precision, case.steps, world, per, str(device))
    if key not in _REFERENCES:
        torch.manual_seed(0)
        model = factory(kind)().to(device)
        reference = Reference(model, case, world)
        batches = make_batches(kind, steps=case.steps, global_batch=world * case.micro * per)
        losses = [reference.step(tuple(t.to(device) for t in batch), per) for batch in batches]
        _REFERENCES[key] = ReferenceRun(losses=losses, state=model.state_dict(), buffers=reference.buffers)
    return _REFERENCES[key]


def run_case(kind: str, case: Case) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = factory(kind)().to(device)  # the reference's initial weights (reference_run seeds alike)
    st.shard(
        model,
        strategy=case.strategy,
        wrap=wrap_policy(kind),
        mixed_precision=case.precision,
        activation_checkpointing=ac_policy(kind) if case.ac else None,
        mesh=case.mesh,
        cpu_offload=st.CPUOffload(fraction=case.offload) if isinstance(case.offload, float) else case.offload,
    )
    opt = make_optimizer(model, case.optim)
    per = 2
    reference = reference_run(kind, case, world=world, per=per, device=device)
    tol = LOW_PRECISION_CUDA_TOL if case.precision and device.type == "cuda" else FP32_TOL
    for step, batch in enumerate(make_batches(kind, steps=case.steps, global_batch=world * case.micro * per)):
        batch = tuple(t.to(device) for t in batch)
        loss_sum = 0.0
        for m in range(case.micro):
            sync_off = case.accum == "no_sync" and m < case.micro - 1
            with st.no_sync(model) if sync_off else contextlib.nullcontext():
                loss = lm_loss(model, _chunk(batch, rank, case.micro, m, per)) / case.micro
                loss.backward()
            loss_sum += loss.detach()
        if case.clip is not None:
            norm = st.clip_grad_norm_(model, case.clip)
            norms = [torch.zeros_like(norm) for _ in range(world)]
            dist.all_gather(norms, norm)
            assert all(torch.equal(n, norm) for n in norms), f"grad norm differs across ranks: {norms}"
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(
            loss_sum.float(),
            reference.losses[step][rank].float(),
            **tol,
            msg=lambda m: f"{kind} {case} step {step} rank {rank}: loss {m}",
        )
    full = st.full_state_dict(model, rank0_only=False)
    expected = dict(reference.state)
    for name, b in reference.buffers[rank].items():
        if name in expected:
            expected[name] = b
    expected = {k: v.cpu() for k, v in expected.items()}
    assert list(full) == list(expected), f"state dict keys differ: {list(full)} vs {list(expected)}"
    for name in expected:
        torch.testing.assert_close(
            full[name], expected[name], **tol, msg=lambda m: f"{kind} {case} rank {rank}: {name}: {m}"
        )


def run_cases(kind: str, cases: list[Case]) -> int:
    for case in cases:
        run_case(kind, case)
    return len(cases)


def run_cases_gathering(mode: str, kind: str, cases: list[Case]) -> int:
    """`run_cases` with units gathered in `mode` (`SHARDTRAIN_GATHER`), set on this rank for the call."""
    before = os.environ.get("SHARDTRAIN_GATHER")
    os.environ["SHARDTRAIN_GATHER"] = mode
    try:
        assert resolve_options().gather is GatherMode(mode)
        return run_cases(kind, cases)
    finally:
        if before is None:
            del os.environ["SHARDTRAIN_GATHER"]
        else:
            os.environ["SHARDTRAIN_GATHER"] = before
