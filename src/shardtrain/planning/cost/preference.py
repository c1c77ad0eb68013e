"""DPO's reference model in a memory bill: nothing, or a frozen copy of the model sharded beside it.

With LoRA the reference is the base with its adapters disabled, and with precomputed reference
log-probabilities there is none: neither adds memory (each answer is a row, so the caller bills twice the
pairs as sequences). A full fine-tune's frozen copy is stored in the compute dtype (it has no fp32
master, gradient or optimizer state), each rank keeping its shard (all of it under no_shard); its units
are gathered for the reference forward under no_grad, before the policy's forward, and freed, so what
stays through the step is its shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any

REFERENCES = ("none", "frozen_copy")


def with_reference(estimate: Any, *, reference: str) -> Any:
    """`estimate` (a MemoryEstimate) with the reference model's resident bytes added to every moment."""
    if reference not in REFERENCES:
        raise ValueError(
            f"reference={reference!r} is invalid: use 'none' (LoRA, whose reference is the base with the adapters "
            "off, or precomputed log-probabilities) or 'frozen_copy' (a full fine-tune's frozen copy)"
        )
    if reference == "none":
        return estimate
    inputs = estimate.inputs
    copy = inputs.model.num_params * inputs.param_bytes // inputs.shard_size
    return dataclasses.replace(
        estimate,
        parameters=estimate.parameters + copy,
        phase_totals=tuple((name, total + copy) for name, total in estimate.phase_totals),
        notes=(
            *estimate.notes,
            f"DPO's frozen reference copy: {inputs.model.num_params:,} parameters in {inputs.param_bytes} B each, "
            f"sharded over {inputs.shard_size} rank(s)",
        ),
    )
