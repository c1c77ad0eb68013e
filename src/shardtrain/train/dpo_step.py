"""The main job's DPO step and evaluation (train.objective dpo), on every rank.

The loss of a step is the mean DPO loss (dpo.loss: sigmoid or IPO) over the step's pairs (train.batch_size
of them, over all micro-batches and ranks), as if the global batch were one: micro-batch m on a rank
backpropagates the sum of its pairs' losses times world / batch_size, and the engine's gradient average over the ranks restores
the global mean. A micro-batch runs the reference on its rows first (train/dpo_ref.py), then the policy.
TRL's metrics (rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen,
logps/rejected) are summed on each rank in the job's log window (train/log_window.py, kept through
checkpoints) and reduced once per log record; evaluation gives the same over the held-out pairs, with
eval_loss the mean DPO loss per held-out pair.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..data.pack import IGNORE
from .dpo_loss import METRIC_NAMES, PairTerms, dpo_terms, metric_means, metric_sums, sequence_logps
from .dpo_ref import LiveReference, PrecomputedReference
from .packed import forward_logits
from .step import Batch, Job


@dataclass(kw_only=True)
class DpoJob(Job):
    """A `Job` whose objective is DPO on preference pairs (its data: PairBatches)."""

    beta: float
    loss: str  # dpo.loss: sigmoid or ipo
    reference: LiveReference | PrecomputedReference
    window_metrics: ClassVar[int] = len(METRIC_NAMES) + 2  # metric_sums' vector, kept in the log window

    def pair_terms(self, batch: Batch, *, held_out: bool = False) -> PairTerms:
        """The DPO terms of a batch's pairs: the reference's log-probabilities, then the policy's (with grad)."""
        ref = self.reference.logps(batch, held_out=held_out)
        logps = sequence_logps(forward_logits(self.model, batch["input_ids"], position_ids=None), batch["labels"])
        n = batch["pair"].numel()
        tokens = (batch["labels"] != IGNORE).sum(-1).clamp(min=1)  # a padding pair's rows score none
        return dpo_terms(
            chosen_logps=logps[:n],
            rejected_logps=logps[n:],
            ref_chosen_logps=ref[:n],
            ref_rejected_logps=ref[n:],
            beta=self.beta,
            loss=self.loss,
            chosen_tokens=tokens[:n],
            rejected_tokens=tokens[n:],
        )

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        accum = self.cfg.train.grad_accum
        start = time.perf_counter()
        batches = [self.to_device(self.data.train.batch(step * accum + micro)) for micro in range(accum)]
        self.load_s += time.perf_counter() - start
        scale = self.engine.data_parallel_size / self.cfg.train.batch_size
        total = torch.zeros((), device=self.engine.device)
        for micro, batch in enumerate(batches):
            with self.engine.no_backward_sync(self.model, enabled=micro < accum - 1):
                terms = self.pair_terms(batch)
                loss = terms.losses.sum() * scale
                self.engine.backward(loss)
            total += loss.detach()
            self.window.sums += metric_sums(terms, batch["pair"] >= 0).cpu()
        norm, skipped = self.optimizer_step(step, total)
        return total, norm, skipped

    def log_metrics(self) -> dict[str, float]:
        means = metric_means(self.window.take_sums(self.engine))
        means.pop("loss")  # the record's own loss is the step's mean (skipped steps left out)
        return means

    @torch.no_grad()
    def held_out_metrics(self) -> dict[str, float]:
        """eval_loss (the mean DPO loss per held-out pair) and TRL's metrics of the held-out pairs, over every
        held-out batch (or train.eval_batches of them), the same for any batch or world size."""
        held_out = self.data.held_out
        self.model.eval()
        sums = torch.zeros(len(METRIC_NAMES) + 2)
        for index in range(held_out.held_out_batches(self.cfg.train.eval_batches)):
            batch = self.to_device(held_out.batch(index))
            sums += metric_sums(self.pair_terms(batch, held_out=True), batch["pair"] >= 0).cpu()
        self.model.train()
        return metric_means(self.engine.all_reduce(sums, op="sum").cpu(), prefix="eval_")

    def held_out_loss(self) -> float:
        return self.held_out_metrics()["eval_loss"]

    def evaluate(self, step: int, elapsed: float) -> dict | None:
        if self.data.held_out is None:
            return None
        record = {"kind": "eval", "step": step, **self.held_out_metrics(), "elapsed_s": round(elapsed, 3)}
        if self.ema is not None:
            with self.ema.swapped_in():
                record["eval_loss_ema"] = self.held_out_loss()
        return record


def preference_line(record: dict) -> str:
    """The DPO evaluation's preference accuracy and margin for the console ('' for the LM loss)."""
    if "eval_rewards/accuracies" not in record:
        return ""
    return f", preference accuracy {record['eval_rewards/accuracies']:.3f}, margin {record['eval_rewards/margins']:.3f}"
