"""Rank side of the loss-normalisation test: one training step of the main job, its full gradients."""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from shardtrain.engine import Engine
from shardtrain.train.config import load_config
from shardtrain.train.loop import build_job


def one_step(folder: str, data: str, cache: str, *extra: str) -> dict:
    """The gradient of step 0 (gathered whole, by parameter name) and the step's logged mean loss."""
    engine = Engine(accelerator="cpu")
    engine.launch()
    cfg = load_config(
        None,
        [
            "--model.pretrained",
            folder,
            "--data.path",
            data,
            "--data.eval_path",
            data,
            "--data.seq_len",
            "48",
            "--data.cache_dir",
            cache,
            "--train.batch_size",
            "8",
            "--optim.grad_clip",
            "0",
            "--run.progress",
            "false",
            *extra,
        ],
    )
    job = build_job(cfg, engine)[0]
    grads = {}

    def capture(*_):
        for name, p in job.model.named_parameters():
            grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()

    job.optimizer.register_step_pre_hook(capture)
    loss, _, _ = job.train_step(0)
    return {"grads": grads, "loss": engine.all_reduce(loss).item()}
