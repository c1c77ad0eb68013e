"""The per-process timing loop: `python -m shardtrain.bench.worker --json-out FILE <RunSpec options>`.

Started by torchrun (one process per device). Each rank builds the engine's model, trains on its
own random batches for `warmup` steps, resets the peak-memory counters, times `steps` steps, then
optionally profiles a few more. Rank 0 writes one JSON result to FILE: per-step times (the slowest
rank's), the loss of every step (averaged over ranks), peak memory (the highest rank's), and the
profile breakdown.

A rank that fails writes FILE.rank<r>.json with its status ("out of memory", or "failed" and the
error) and exits non-zero, which makes torchrun stop its peers instead of leaving them blocked in a
collective.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import traceback
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .data import Batch, token_batches
from .engines import Prepared, compile_blocks
from .profile import profile_steps
from .registry import resolve_engine
from .spec import RunSpec, add_spec_arguments, spec_from_args
from .timing import StepTimer, peak_memory_gib, reset_peak_memory

OUT_OF_MEMORY = "out of memory"


def train_step(prepared: Prepared, batch: Batch) -> torch.Tensor:
    """One optimizer step on one batch; returns the loss (not synchronised with the host)."""
    tokens, targets = batch
    autocast = (
        torch.autocast(tokens.device.type, dtype=prepared.autocast_dtype)
        if prepared.autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with autocast:
        logits = prepared.model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    prepared.optimizer.step()
    prepared.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def measure(spec: RunSpec, device: torch.device) -> dict:
    """Build, warm up, time and (optionally) profile; return rank 0's result record (all ranks call it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = resolve_engine(spec.engine)
    prepared = engine.build(spec, device)
    label = prepared.label or engine.label
    if spec.compile:
        compile_blocks(prepared.model)
        label += " float8 compiled" if spec.float8 else " compiled"
    if device.type == "cuda":
        torch.cuda.empty_cache()  # initialisation transients must not count as reserved training memory
    batches = token_batches(
        vocab_size=spec.model_config().vocab_size,
        batch=spec.batch,
        seq=spec.seq,
        steps=spec.total_steps,
        rank=rank,
        seed=spec.seed,
        device=device,
    )
    timer = StepTimer(device)
    losses = []
    for i, batch in enumerate(batches[: spec.warmup + spec.steps]):
        timed = i >= spec.warmup
        if i == spec.warmup:
            reset_peak_memory(device)
        if timed:
            timer.start()
        losses.append(train_step(prepared, batch))
        if timed:
            timer.stop()
    step_ms = torch.tensor(timer.milliseconds(), dtype=torch.float64, device=device)
    memory = peak_memory_gib(device)
    extra = iter(batches[spec.warmup + spec.steps :])
    breakdown = None
    if spec.profile_steps and rank == 0:
        breakdown = profile_steps(
            lambda: train_step(prepared, next(extra)),
            steps=spec.profile_steps,
            device=device,
            trace_path=spec.trace_path,
        )
    else:
        for batch in extra:
            train_step(prepared, batch)

    dist.all_reduce(step_ms, op=dist.ReduceOp.MAX)
    loss_sum = torch.stack(losses).double()
    dist.all_reduce(loss_sum)
    peaks = torch.tensor([-1.0 if v is None else v for v in memory.values()], dtype=torch.float64, device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return {
        "status": "ok",
        "engine": engine.name,
        "label": label,
        "spec": asdict(spec),
        "world": world,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "step_ms": step_ms.tolist(),
        "losses": (loss_sum / world).tolist(),
        "memory_gib": {k: (None if v < 0 else v) for k, v in zip(memory, peaks.tolist())},
        "breakdown": breakdown.to_dict() if breakdown else None,
        "trace": spec.trace_path if spec.profile_steps and spec.trace_path else None,
    }


def failure_path(json_out: str, rank: int) -> str:
    return f"{json_out}.rank{rank}.json"


def _device(spec: RunSpec) -> torch.device:
    if spec.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but CUDA is not available in this process")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardtrain.bench.worker", description=__doc__.splitlines()[0])
    add_spec_arguments(parser)
    parser.add_argument("--json-out", required=True, help="where rank 0 writes the result")
    args = parser.parse_args(argv)
    spec = spec_from_args(args)
    device = _device(spec)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    try:
        result = measure(spec, device)
    except Exception as exc:
        oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
        if not oom:
            traceback.print_exc()
        with open(failure_path(args.json_out, rank), "w") as f:
            json.dump({"status": OUT_OF_MEMORY if oom else "failed", "error": f"{type(exc).__name__}: {exc}"[:2000]}, f)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)  # no teardown: a peer may be blocked in a collective; torchrun stops it
    if rank == 0:
        with open(args.json_out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
