"""Rank-side code of the overlapped host step tests (offload/host_step.py): the deferred per-unit steps
against the user's own sequential `step()`, bit for bit.

On a CPU device nothing is offloaded, so the tests hand every unit to `overlap_host_steps`, which runs
the same deferral and ordering as offloaded units on a GPU do: steps on the worker thread in forward
order, each waited for by its unit's pre-forward hook; with `in_backward`, units step during backward
(CPUOffload(step_in_backward=True)) where the loop allows it.

Two loops: the plain one accumulates 4 micro-batches into `.grad`, clips (firing on some steps) and
skips the step whose loss was made infinite; the `in_backward` one accumulates under `st.no_sync`, the
loop step_in_backward is for, and clips and skips only when `clip`.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import shardtrain as st
from shardtrain.core.shard_module import runtime_of
from shardtrain.core.sharded_param import local_of
from shardtrain.models.llama import Block
from shardtrain.offload.host_step import HostSteps, overlap_host_steps
from shardtrain.options import HOST_STEP_ENV
from tests.core.parity import _chunk, nanogpt_groups
from tests.models import lm_loss, make_batches, tiny_llama

MICRO, PER = 4, 2  # micro-batches per step, sequences per micro-batch per rank
INF_STEP, CHECKPOINT_STEP = 3, 5
MAX_NORM_AT_2 = 0.7  # at two ranks the tiny Llama's norms straddle it: some steps clip, some do not


def max_norm() -> float:
    """The clipping threshold for this world size: the global batch grows with the ranks and the norm
    of its mean gradient shrinks about as 1 / sqrt(batch), so the norms straddle it at any world."""
    return MAX_NORM_AT_2 * math.sqrt(2 / dist.get_world_size())


SLEEP_S = 0.05  # injected into every deferred unit step


@dataclass(kw_only=True)
class Run:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    steps: HostSteps | None  # None: the user's step() steps everything, in sequence
    stepped: list[int]  # deferred unit steps run, and of them during backward (shared across a resume)
    in_backward: bool
    clip: bool


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    groups = nanogpt_groups(model, 0.1)
    if name == "adamw_fused":
        return torch.optim.AdamW(groups, lr=1e-2, eps=1e-6, fused=True)
    if name == "adam_foreach":
        return torch.optim.Adam(groups, lr=1e-2, eps=1e-6, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    return torch.optim.Adagrad(groups, lr=1e-2)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def build(
    *, overlapped: bool, optim: str, stepped: list[int] | None = None, in_backward: bool = False, clip: bool = True
) -> Run:
    """On CUDA the units are offloaded and `st.shard` defers their steps unless SHARDTRAIN_HOST_STEP is
    sequential; on the CPU nothing is offloaded and every unit is handed to `overlap_host_steps`."""
    torch.manual_seed(0)
    model = tiny_llama().to(device())
    cuda = device().type == "cuda"
    os.environ[HOST_STEP_ENV] = "overlapped" if overlapped else "sequential"
    try:
        offload = st.CPUOffload(step_in_backward=in_backward) if cuda else False
        st.shard(model, strategy="full_shard", wrap={Block}, cpu_offload=offload)
    finally:
        del os.environ[HOST_STEP_ENV]
    optimizer = make_optimizer(model, optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.8**s)
    stepped = [0, 0] if stepped is None else stepped
    runtime = runtime_of(model)
    steps = runtime.step_hook if isinstance(runtime.step_hook, HostSteps) else None
    if overlapped and not cuda:
        steps = overlap_host_steps(model, runtime, runtime.units, in_backward=in_backward)
    assert (steps is not None) == overlapped
    if overlapped:
        step_unit = steps._step_unit

        def slow_step(task) -> None:  # a host step slower than the forward (or backward) beside it
            time.sleep(SLEEP_S)
            step_unit(task)
            stepped[0] += 1
            stepped[1] += task.in_backward

        steps._step_unit = slow_step
    return Run(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        steps=steps,
        stepped=stepped,
        in_backward=in_backward,
        clip=clip,
    )


def train_step(run: Run, batch, step: int) -> float:
    """Accumulate MICRO micro-batches (under st.no_sync but the last, in_backward), clip and skip a
    non-finite step (the guard) when the loop clips, else step; the norm (0 when not clipping)."""
    rank = dist.get_rank()
    for m in range(MICRO):
        with st.no_sync(run.model, enabled=run.in_backward and m < MICRO - 1):
            loss = lm_loss(run.model, _chunk(batch, rank, MICRO, m, PER)) / MICRO
            if run.clip and step == INF_STEP and m == 0:
                loss = loss * math.inf
            loss.backward()
    norm = st.clip_grad_norm_(run.model, max_norm()).item() if run.clip else 0.0
    if math.isfinite(norm):
        if run.steps is not None and run.in_backward and not run.clip and step not in FIRST_STEPS:
            assert len(run.steps.early.stepped) == len(run.steps.units), step
        run.optimizer.step()
        if run.steps is not None and step > 0:
            assert run.steps.pending(), f"step {step}: nothing deferred"
            flush = FLUSHES.get(step)
            if flush is not None:  # whatever reads what a pending step writes completes it first
                flush(run)
                assert not run.steps.pending(), f"step {step}: steps still pending after the flush"
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=step != ZERO_IN_PLACE_STEP)
    return norm


ZERO_IN_PLACE_STEP = 7  # zero_grad(set_to_none=False): zeroing in place waits for the pending steps
FLUSHES = {
    1: lambda run: run.model.state_dict(),
    2: lambda run: run.optimizer.state_dict(),
    ZERO_IN_PLACE_STEP: lambda run: run.optimizer.zero_grad(set_to_none=False),
}


# The steps whose backward comes before the optimizer's first step() (one creates the state, one
# follows the resume): their units step after backward even in_backward.
FIRST_STEPS = (0, CHECKPOINT_STEP + 1)


def checkpoint_and_resume(run: Run, *, overlapped: bool, optim: str, directory: str) -> Run:
    state = {"model": run.model, "optimizer": run.optimizer, "scheduler": run.scheduler}
    st.save_checkpoint(directory, state)  # with steps pending: it must complete them first
    fresh = build(overlapped=overlapped, optim=optim, stepped=run.stepped, in_backward=run.in_backward, clip=run.clip)
    st.load_checkpoint(directory, {"model": fresh.model, "optimizer": fresh.optimizer, "scheduler": fresh.scheduler})
    return fresh


def final_state(run: Run) -> list[tuple[str, torch.Tensor]]:
    """Every parameter's local rows and its optimizer state, by name (pending steps completed first)."""
    runtime_of(run.model)
    names = {id(p): n for n, p in run.model.named_parameters()}
    out = []
    for group in run.optimizer.param_groups:
        for p in group["params"]:
            out.append((names[id(p)], local_of(p).detach().clone()))
            for key, value in sorted(run.optimizer.state[p].items()):
                out.append((f"{names[id(p)]}/{key}", local_of(value).clone()))
    return out


def overlapped_equals_sequential(
    directory: str, optim: str, steps: int, resume: bool, in_backward: bool = False, clip: bool = True
) -> int:
    """Train both ways on the same batches; assert the norms and the final state bitwise equal, and how
    many unit steps ran deferred and during backward."""
    world = dist.get_world_size()
    batches = [
        tuple(t.to(device()) for t in batch)
        for batch in make_batches("llama", steps=steps, global_batch=world * MICRO * PER)
    ]
    finals, norms = {}, {}
    for overlapped in (False, True):
        run = build(overlapped=overlapped, optim=optim, in_backward=in_backward, clip=clip)
        norms[overlapped] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step, batch in enumerate(batches):
                norms[overlapped].append(train_step(run, batch, step))
                if resume and step == CHECKPOINT_STEP:
                    path = f"{directory}/{optim}-{overlapped}"
                    run = checkpoint_and_resume(run, overlapped=overlapped, optim=optim, directory=path)
        finals[overlapped] = final_state(run)
        if overlapped:
            units = len(runtime_of(run.model).units)
            # every step but the first (it creates the state, in sequence) and the skipped one, per unit
            expected = (steps - 1 - (clip and INF_STEP < steps)) * units
            assert run.stepped[0] == expected, f"{optim}: {run.stepped[0]} deferred unit steps, expected {expected}"
            early = (steps - len([s for s in FIRST_STEPS if s < steps and (resume or s == 0)])) * units
            early = early if in_backward and not clip else 0
            assert run.stepped[1] == early, f"{optim}: {run.stepped[1]} unit steps in backward, expected {early}"
            said = [str(w.message) for w in caught if "step_in_backward" in str(w.message)]
            # one warning per model (the resumed run builds another), naming what the loop does
            assert len(said) == (1 + resume) * (in_backward and clip) and all("clips" in m for m in said), said
    assert norms[True] == norms[False] or _same_nan(norms), f"{optim}: norms differ: {norms}"
    finite = [n for n in norms[False] if math.isfinite(n)]
    assert not (resume and clip) or any(n > max_norm() for n in finite) and any(n <= max_norm() for n in finite), (
        f"clipping never varied: {finite}"
    )
    assert [n for n, _ in finals[True]] == [n for n, _ in finals[False]]
    for (name, got), (_, want) in zip(finals[True], finals[False]):
        assert torch.equal(got, want), f"{optim}: {name} differs: max |diff| {(got.float() - want.float()).abs().max()}"
    return len(finals[True])


def _same_nan(norms: dict[bool, list[float]]) -> bool:
    return all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(norms[True], norms[False]))


def falls_back_once(optim: str) -> list[str]:
    """An optimizer that cannot be split (Adagrad) or a closure: the user's step, in sequence, and one
    warning; the result equals the sequential run's."""
    world = dist.get_world_size()
    batches = [
        tuple(t.to(device()) for t in b) for b in make_batches("llama", steps=2, global_batch=world * MICRO * PER)
    ]
    results, messages = {}, []
    for overlapped in (False, True):
        run = build(overlapped=overlapped, optim=optim)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batch in batches:
                loss = lm_loss(run.model, _chunk(batch, dist.get_rank(), 1, 0, PER))
                loss.backward()
                if optim == "adamw_fused":
                    run.optimizer.step(lambda: loss)  # a closure
                else:
                    run.optimizer.step()
                run.optimizer.zero_grad()
        messages += [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert run.stepped[0] == 0, f"{optim}: {run.stepped[0]} unit steps deferred"
        results[overlapped] = final_state(run)
    for (name, got), (_, want) in zip(results[True], results[False]):
        assert torch.equal(got, want), f"{optim} fallback: {name} differs"
    return messages


def in_backward_error(case: str) -> str:
    """Units step during backward, then the loop does what step_in_backward cannot make exact: clipping
    that fires (shardtrain's or torch's), a step the guard skips after an infinite loss, the learning
    rate changed between backward and step(). Returns the error this raises (one micro-batch a step)."""
    world = dist.get_world_size()
    batches = [tuple(t.to(device()) for t in b) for b in make_batches("llama", steps=3, global_batch=world * PER)]
    run = build(overlapped=True, optim="adamw_fused", in_backward=True, clip=False)
    try:
        for step, batch in enumerate(batches):
            loss = lm_loss(run.model, _chunk(batch, dist.get_rank(), 1, 0, PER))
            last = step == len(batches) - 1
            if last and case == "skip":
                loss = loss * math.inf
            loss.backward()
            if last:
                assert run.steps.early.stepped, "nothing stepped during backward"
                if case == "clip":
                    st.clip_grad_norm_(run.model, 1e-6)
                elif case == "torch_clip":
                    torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1e-6)
                elif case == "lr":
                    run.scheduler.step()  # before optimizer.step(): the units stepped with the old rate
            if torch.isfinite(loss):
                run.optimizer.step()
            run.optimizer.zero_grad()
    except RuntimeError as error:
        return str(error)
    finally:
        runtime_of(run.model)  # the worker finishes before the next test reuses the ranks
    raise AssertionError(f"{case}: no error")


def in_backward_falls_back(case: str) -> list[str]:
    """A loop that shows something global at its first step(): two synchronising backwards a step
    (accumulation without st.no_sync), or torch's clipping between backward and step(). No unit steps
    during backward; the warnings."""
    world = dist.get_world_size()
    batches = [tuple(t.to(device()) for t in b) for b in make_batches("llama", steps=3, global_batch=world * 2 * PER)]
    run = build(overlapped=True, optim="adamw_fused", in_backward=True, clip=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            for m in range(2 if case == "accumulate" else 1):
                lm_loss(run.model, _chunk(batch, dist.get_rank(), 2, m, PER)).backward()
            if case == "torch_clip":  # foreach ops on the DTensor gradients: no version changes
                torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1e-3)
            run.optimizer.step()
            run.optimizer.zero_grad()
    runtime_of(run.model)
    assert run.stepped == [2 * len(run.steps.units), 0], run.stepped
    return [str(w.message) for w in caught if "step_in_backward" in str(w.message)]
