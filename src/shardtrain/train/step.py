"""One run's step, evaluation and checkpoint logic, on every rank.

The loss of a step is the cross-entropy summed over every trained token of the step (all its
micro-batches, all ranks) divided by the number of those tokens, as if the whole global batch were one:
rows of unequal length weigh by their tokens, whatever the accumulation or the world size. Each rank
counts its micro-batches' trained tokens and one all-reduce per step sums them (the byte corpus trains
every token, so its count is known and skips it); micro-batch m then backpropagates
`sum_loss(m) * world / count`, the engine's gradient average over the ranks restoring the global mean.
Under tensor parallelism "world" is the data-parallel ranks: the ranks of one tp group hold the same rows.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from ..data.pack import IGNORE
from ..data.stream import StreamBatches
from ..engine import Engine
from .early_stop import EarlyStop
from .ema import WeightEMA
from .finetune import checkpoint_params
from .finite import NonFiniteGuard
from .head_loss import head_loss_sum, output_head
from .inputs import TrainData
from .log_window import LogWindow
from .packed import forward_logits
from .samples import greedy_samples
from .sections import Config
from .state import check_data_position, data_position

Batch = dict[str, torch.Tensor]


def loss_sum(model: nn.Module, batch: Batch, *, packed: bool, vocab_size: int, chunked: bool) -> torch.Tensor:
    """Summed next-token cross-entropy (in fp32) over the batch's trained labels (labels are already shifted).
    Packed windows go through train/packed.py's forward, which keeps their documents apart. `chunked`:
    through train/head_loss.py, in chunks of rows that never hold the logits (train.chunked_loss)."""
    position_ids = batch["position_ids"] if packed else None
    if chunked:
        _check_vocab(output_head(model).out_features, vocab_size)
        return head_loss_sum(model, batch["input_ids"], labels=batch["labels"], position_ids=position_ids)
    logits = forward_logits(model, batch["input_ids"], position_ids=position_ids)
    _check_vocab(logits.size(-1), vocab_size)
    loss = F.cross_entropy(
        logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE, reduction="sum"
    )
    # engine.loss_parallel: a DTensor over the tp ranks (replicated: full_tensor() moves nothing)
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _check_vocab(classes: int, vocab_size: int) -> None:
    if classes < vocab_size:
        raise ValueError(
            f"the model predicts {classes} classes but the tokenizer has {vocab_size} tokens; "
            f"give the model a vocabulary of at least {vocab_size} (e.g. --model.kwargs.vocab_size {vocab_size})"
        )


@dataclass(kw_only=True)
class Job:
    """The objects of one run, shared by the step, evaluation and checkpoint helpers."""

    cfg: Config
    engine: Engine
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: TrainData
    vocab_size: int
    chunked_loss: bool  # the loss through train/head_loss.py (train.chunked_loss, decided by build_job)
    ema: WeightEMA | None
    guard: NonFiniteGuard
    stopper: EarlyStop | None = None  # train.early_stop_patience; its state is checkpointed with the run
    load_s: float = 0.0  # host seconds spent reading batches since the last log record (the loop resets it)
    window: LogWindow = field(init=False)  # what the loop has trained since its last log record (checkpointed)
    window_metrics: ClassVar[int] = 0  # the objective's own sums in the window (none for the LM loss)

    def __post_init__(self) -> None:
        self.window = LogWindow.empty(device=self.engine.device, metrics=self.window_metrics)

    def to_device(self, batch: Batch) -> Batch:
        """The batch on the device; on CUDA through pinned memory, so the copy does not wait for the
        device to finish the previous step (a copy from pageable memory would)."""
        if self.engine.device.type != "cuda":
            return batch
        return {k: t.pin_memory().to(self.engine.device, non_blocking=True) for k, t in batch.items()}

    def trained_tokens(self, batches: list[Batch]) -> torch.Tensor:
        """Trained tokens of the whole global step: known for the byte corpus, else one all-reduce."""
        if self.data.train.all_trained:
            per_rank = sum(b["labels"].numel() for b in batches)
            return torch.tensor(float(per_rank * self.engine.data_parallel_size), device=self.engine.device)
        mine = sum((b["labels"] != IGNORE).sum() for b in batches).float()
        return (self.engine.all_reduce(mine, op="sum") / self.engine.tp).clamp(min=1)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """torch's `loss_parallel()` around a loss and its backward when the logits stay split over the tp
        ranks (engine.loss_parallel: the cross-entropy runs on each rank's share of the vocabulary)."""
        return loss_parallel() if self.cfg.engine.loss_parallel else contextlib.nullcontext()

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """One optimizer step; returns (this rank's share of the step's mean loss per trained token, gradient
        norm before clipping, whether the step was skipped for a non-finite loss or norm)."""
        accum = self.cfg.train.grad_accum
        start = time.perf_counter()
        batches = [self.to_device(self.data.train.batch(step * accum + micro)) for micro in range(accum)]
        self.load_s += time.perf_counter() - start
        scale = self.engine.data_parallel_size / self.trained_tokens(batches)
        total = torch.zeros((), device=self.engine.device)
        for micro, batch in enumerate(batches):
            with self.engine.no_backward_sync(self.model, enabled=micro < accum - 1), self.loss_context():
                loss = (
                    loss_sum(
                        self.model,
                        batch,
                        packed=self.data.packed,
                        vocab_size=self.vocab_size,
                        chunked=self.chunked_loss,
                    )
                    * scale
                )
                self.engine.backward(loss)
            total += loss.detach()
        norm, skipped = self.optimizer_step(step, total)
        return total, norm, skipped

    def optimizer_step(self, step: int, total: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """After the step's backwards: clip, step the optimizer unless the loss `total` or the norm is
        non-finite (train.on_nonfinite), the scheduler and the EMA; (gradient norm, whether skipped)."""
        norm = None
        if self.cfg.optim.grad_clip > 0:
            norm = self.engine.clip_gradients(self.model, self.optimizer, max_norm=self.cfg.optim.grad_clip)
        skipped = self.guard.skips(step + 1, total, norm)
        if not skipped:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None and not skipped:
            self.ema.update()
        return norm, skipped

    def log_metrics(self) -> dict[str, float]:
        """The objective's own training metrics since the last log (every rank calls it; none for the LM loss)."""
        return {}

    @torch.no_grad()
    def held_out_loss(self) -> tuple[float, dict[str, float]]:
        """Mean cross-entropy per trained held-out token over the evaluated windows: all of them, or the
        first train.eval_batches micro-batches (of each source's, with several: data.held_out_sources),
        and each such source's own. Every rank runs the same forwards (the sharded forward gathers), a
        partial last batch padded with rows that train nothing; one all-reduce sums the losses and trained
        tokens of every rank, so the losses do not depend on the batch or world size."""
        parts = self.data.held_out_sources or (("", self.data.held_out),)
        self.model.eval()
        sums = torch.zeros(len(parts), 2, device=self.engine.device)
        for part, (_, held_out) in enumerate(parts):
            for index in range(held_out.held_out_batches(self.cfg.train.eval_batches)):
                batch = self.to_device(held_out.batch(index))
                with self.loss_context():
                    sums[part, 0] += loss_sum(
                        self.model,
                        batch,
                        packed=self.data.packed,
                        vocab_size=self.vocab_size,
                        chunked=self.chunked_loss,
                    )
                sums[part, 1] += (batch["labels"] != IGNORE).sum()
        self.model.train()
        sums = self.engine.all_reduce(sums, op="sum").cpu()
        losses = (sums[:, 0] / sums[:, 1].clamp(min=1)).tolist()
        total = sums.sum(dim=0)
        overall = (total[0] / total[1].clamp(min=1)).item()
        return overall, {name: loss for (name, _), loss in zip(parts, losses) if name}

    def evaluate(self, step: int, elapsed: float) -> dict | None:
        """The eval record of `step` (with several held-out sources, each one's loss under `loss`, logged as
        eval/loss/<source>); None when nothing is held out (data.val_fraction 0)."""
        if self.data.held_out is None:
            return None
        loss, by_source = self.held_out_loss()
        record = {"kind": "eval", "step": step, "eval_loss": loss, "elapsed_s": round(elapsed, 3)}
        if by_source:
            record["loss"] = by_source
        if self.ema is not None:
            with self.ema.swapped_in():
                record["eval_loss_ema"] = self.held_out_loss()[0]
        return record

    def samples(self, step: int) -> list[dict]:
        """eval.samples: the held-out prompts decoded greedily (every rank runs the same forwards)."""
        if not self.data.prompts:
            return []
        rows = greedy_samples(
            self.model,
            self.data.prompts,
            tokenizer=self.data.tokenizer,
            max_new_tokens=self.cfg.eval.max_new_tokens,
            device=self.engine.device,
        )
        return [{"step": step, **row} for row in rows]

    def checkpoint_state(self) -> dict:
        state = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}
        if self.engine.grad_scaler is not None:
            state["grad_scaler"] = self.engine.grad_scaler
        if self.ema is not None:
            state["ema"] = self.ema
        if isinstance(self.data.train, StreamBatches):
            state["stream"] = self.data.train  # this rank's position in its stream (data/stream.py)
        return state

    def save(self, run_dir: Path, step: int) -> None:
        state = self.checkpoint_state()
        state["data"] = data_position(step=step, batch_size=self.cfg.train.batch_size)
        if self.stopper is not None:
            state["early_stop"] = self.stopper.state_dict()
        state["log_window"] = self.window.gathered(self.engine)
        self.engine.save(str(run_dir / "checkpoints" / f"step_{step:06d}"), state, params=checkpoint_params(self.cfg))

    def resume(self, path: str) -> int:
        """Load the checkpoint at `path` into the job; return the step to continue from."""
        rest = self.engine.load(path, self.checkpoint_state(), params=checkpoint_params(self.cfg))
        if self.stopper is not None and "early_stop" in rest:
            self.stopper.load_state_dict(rest["early_stop"])
        if "log_window" in rest:  # absent from checkpoints written before the window was kept
            self.window.restore(rest["log_window"], engine=self.engine)
        return check_data_position(rest["data"], batch_size=self.cfg.train.batch_size)
