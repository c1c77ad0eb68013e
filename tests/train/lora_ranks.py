"""Rank side of the LoRA target test: the main job's adapters and one training step of them."""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from tests.train.jobs import pretrained_job


def _trainable(model) -> dict:
    """Every trainable parameter, whole (gathered), by name."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def lora_step(folder: str, data: str, cache: str, *extra: str) -> dict:
    """The peft config's target_modules, the base layers that got adapters, and the trainable parameters
    (by name) before and after one optimizer step of LoRA r=4."""
    lora = ["--lora.rank", "4", "--train.batch_size", "4", "--optim.lr", "1e-2", "--optim.warmup_steps", "0"]
    job = pretrained_job(folder, data, cache, *lora, *extra)
    before = _trainable(job.model)
    job.train_step(0)
    return {
        "target_modules": job.model.peft_config["default"].target_modules,
        "adapted": sorted(n for n, m in job.model.get_base_model().named_modules() if hasattr(m, "lora_A")),
        "before": before,
        "after": _trainable(job.model),
    }
