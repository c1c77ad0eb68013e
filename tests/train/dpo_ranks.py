"""Rank side of the DPO tests: the main job with train.objective dpo, one optimizer step of plain SGD."""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from tests.train.jobs import pretrained_job

# lr 1, no momentum, decay, clipping or warm-up: the step moves each trained weight by exactly -gradient
SGD = [
    "--optim.name", "sgd", "--optim.lr", "1.0", "--optim.momentum", "0", "--optim.weight_decay", "0",
    "--optim.grad_clip", "0", "--optim.warmup_steps", "0", "--optim.schedule", "constant",
]  # fmt: skip


def _trainable(model) -> dict:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def dpo_step(folder: str, data: str, cache: str, *extra: str) -> dict:
    """The trained weights before and after step 0, the step's pairs as this rank batched them, its loss
    (this rank's share of the mean) and TRL's metrics of the step."""
    job = pretrained_job(folder, data, cache, "--train.objective", "dpo", *SGD, *extra)
    accum = job.cfg.train.grad_accum
    before = _trainable(job.model)
    batches = [job.data.train.batch(micro) for micro in range(accum)]
    loss, _, _ = job.train_step(0)
    reference = getattr(job.reference, "train", None)
    return {
        "before": before,
        "after": _trainable(job.model),
        "batches": batches,
        "loss": float(job.engine.all_reduce(loss)),
        "metrics": job.log_metrics(),
        "precomputed": None if reference is None else reference.cpu(),
        "eval": job.evaluate(1, 0.0),
    }
