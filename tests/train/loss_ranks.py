"""Rank side of the loss-normalisation test: one training step of the main job, its full gradients."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.tensor import DTensor

from shardtrain.engine import Engine
from shardtrain.train.config import load_config
from shardtrain.train.loop import build_job
from tests.train.facts import llama_folder, write_jsonl

WORDS = "the quick brown fox jumps over a lazy dog and runs far away into green hills".split()


def uneven_rows_case(root: Path) -> tuple[str, str, str]:
    """(a LlamaForCausalLM folder, a prompt/completion file of 16 rows of unequal lengths, a cache directory)."""
    rows = [
        {"prompt": f"Q: {WORDS[i]}?\nA:", "completion": " " + " ".join(WORDS[: 1 + (i * 7) % 16])} for i in range(16)
    ]
    return (
        str(llama_folder(root / "model", hidden=32, init_range=0.5)),
        str(write_jsonl(rows, root / "rows.jsonl")),
        str(root / "cache"),
    )


def one_step(folder: str, data: str, cache: str, *extra: str) -> dict:
    """The gradient of step 0 (gathered whole, by parameter name) and the step's logged mean loss."""
    return step_zero("--model.pretrained", folder, *data_args(data, cache), *extra)


def data_args(data: str, cache: str) -> list[str]:
    """The options of a step of 8 rows of 48 tokens from `data` (also held out), unclipped."""
    return [
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
    ]


def step_zero(*args: str) -> dict:
    """The gradient of step 0 of the main job configured by `args` (gathered whole, by parameter name), the
    step's logged mean loss, and whether the loss was chunked (train.chunked_loss)."""
    engine = Engine(accelerator="cpu")
    engine.launch()
    job = build_job(load_config(None, list(args)), engine)[0]
    grads = {}

    def capture(*_):
        for name, p in job.model.named_parameters():
            if p.grad is None:  # frozen (LoRA's base)
                continue
            grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()

    job.optimizer.register_step_pre_hook(capture)
    loss, _, _ = job.train_step(0)
    return {"grads": grads, "loss": engine.all_reduce(loss).item(), "chunked": job.chunked_loss}
