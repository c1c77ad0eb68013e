"""The `dpo` section of the main job: preference tuning's settings (used with --train.objective dpo)."""

from __future__ import annotations

from dataclasses import dataclass

from .section_fields import help_field as _help
from .section_fields import require as _require

OBJECTIVES = ("lm", "dpo")
DPO_LOSSES = ("sigmoid", "ipo")  # train/dpo_loss.py


@dataclass(frozen=True, kw_only=True)
class DpoConfig:
    beta: float = _help(
        "with train.objective dpo: the DPO temperature beta (the sigmoid loss -log sigmoid(beta x the policy's "
        "minus the reference's log-ratio of the chosen to the rejected answer); larger keeps closer to the reference",
        0.1,
    )
    loss: str = _help(
        "with train.objective dpo: sigmoid (DPO's -log sigmoid loss) or ipo (IPO's squared loss on the per-token "
        "log-ratios, as TRL's loss_type='ipo'; beta is its regularisation tau)",
        "sigmoid",
    )
    precompute_ref: bool = _help(
        "compute the reference model's log-probabilities of every pair once before training and cache them with "
        "the tokenized pairs (no reference forward during training; with full fine-tuning no frozen copy in "
        "memory). Otherwise: the base with the LoRA adapters disabled, or a frozen sharded copy of the model",
        False,
    )

    def __post_init__(self) -> None:
        _require(self.beta > 0, "dpo.beta", self.beta, "use a positive temperature such as 0.1")
        _require(self.loss in DPO_LOSSES, "dpo.loss", self.loss, f"use one of {', '.join(DPO_LOSSES)}")


def dpo_reference(cfg) -> str:
    """What DPO's reference model costs in memory (planning/cost/preference.py): a full fine-tune's frozen
    copy, or nothing (LoRA disables its adapters; precomputed log-probabilities need no model)."""
    full = cfg.train.objective == "dpo" and not cfg.lora.rank and not cfg.dpo.precompute_ref
    return "frozen_copy" if full else "none"
