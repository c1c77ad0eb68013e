"""The DPO objective on the log-probabilities of preference pairs: the sigmoid loss (Rafailov et al., 2023)
or IPO's squared loss (Azar et al., 2023), `dpo.loss`.

For a pair (x, y_w, y_l) with the policy's summed answer log-probabilities pi_w, pi_l and the reference's
ref_w, ref_l, the implicit rewards are r_w = beta (pi_w - ref_w) and r_l = beta (pi_l - ref_l), and

    sigmoid   loss = -log sigmoid(r_w - r_l)
    ipo       loss = ((pi_w - ref_w) / n_w - (pi_l - ref_l) / n_l - 1 / (2 beta))^2

with n_w, n_l the answers' scored tokens: IPO's log-ratios are per token, as TRL's loss_type="ipo" takes them
(the counts come from each batch's labels, so precomputed reference sums serve both losses). The rewards and
logps TRL logs are the summed ones whichever the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..data.pack import IGNORE


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability (fp32) of its scored labels (-100: not scored): [rows]."""
    scored = labels != IGNORE
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * scored).sum(-1)


@dataclass(frozen=True, kw_only=True)
class PairTerms:
    """Per-pair DPO loss and what TRL logs of it (each a tensor of [pairs])."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


def dpo_terms(
    *,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss: str = "sigmoid",
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> PairTerms:
    """The DPO loss (`loss`: dpo_section.DPO_LOSSES) of each pair and its rewards (the rewards carry no gradient); IPO needs
    each answer's scored token count."""
    chosen = beta * (chosen_logps - ref_chosen_logps)
    rejected = beta * (rejected_logps - ref_rejected_logps)
    if loss == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo_terms(loss='ipo') needs chosen_tokens and rejected_tokens (the answers' lengths)")
        per_token = (chosen_logps - ref_chosen_logps) / chosen_tokens - (rejected_logps - ref_rejected_logps) / (
            rejected_tokens
        )
        losses = (per_token - 1 / (2 * beta)) ** 2
    else:
        losses = -F.logsigmoid(chosen - rejected)
    return PairTerms(
        losses=losses,
        chosen_rewards=chosen.detach(),
        rejected_rewards=rejected.detach(),
        chosen_logps=chosen_logps.detach(),
        rejected_logps=rejected_logps.detach(),
    )


METRIC_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def metric_sums(terms: PairTerms, real: torch.Tensor) -> torch.Tensor:
    """Sums over the real pairs (`real`: bool [pairs]) of the loss and TRL's metrics, then the pair count:
    a vector of [loss, *METRIC_NAMES, count] that one all-reduce adds over the ranks."""
    w = real.float()
    margins = terms.chosen_rewards - terms.rejected_rewards
    columns = (
        terms.losses.detach(),
        terms.chosen_rewards,
        terms.rejected_rewards,
        margins,
        (margins > 0).float(),
        terms.chosen_logps,
        terms.rejected_logps,
    )
    return torch.stack([(c * w).sum() for c in columns] + [w.sum()])


def metric_means(sums: torch.Tensor, *, prefix: str = "") -> dict[str, float]:
    """`metric_sums` added over pairs and ranks -> {loss and the metrics: the mean per pair}."""
    count = max(float(sums[-1]), 1.0)
    names = ("loss", *METRIC_NAMES)
    return {f"{prefix}{name}": float(v) / count for name, v in zip(names, sums[:-1].tolist())}
