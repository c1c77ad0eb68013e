"""The step's summed loss through the model's output head in chunks (`st.chunked_cross_entropy`): the
[tokens, vocab] logits, their fp32 copy and their gradient never exist (train.chunked_loss).

The head stays a module call, so a sharded model still gathers its weight around it: the built-in
Llama's `OutputHead` returns the loss itself; a transformers causal LM (a peft model around one too)
has its head's `forward` swapped, for that call only, for one that returns the summed loss
(`head_returns_loss`), checked once per model by `probe`; `HeadLossProbe.refusal` says why a model is
left out (docs/design.md, Note [Head loss through the module call]).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..models.chunked_ce import head_returns_loss
from ..models.llama import Llama
from ..pretrained.keys import hf_model
from .packed import check_packing_supported, forward_logits
from .packing_probe import PROBE_SHAPE, probe_positions

__all__ = ["HeadLossProbe", "head_loss_sum", "output_head", "probe"]

_FIX = "pass --train.chunked_loss false (the loss over the full logits)"
_PROBES: weakref.WeakKeyDictionary[nn.Module, HeadLossProbe] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, kw_only=True)
class HeadLossProbe:
    """Whether the chunked loss computes `model`'s loss; `reason` says why not."""

    name: str
    reason: str | None = None

    def refusal(self) -> str:
        return f"{self.name}: the chunked loss does not apply ({self.reason}); {_FIX}"


def output_head(model: nn.Module) -> nn.Linear | None:
    """The built-in Llama's head, or a transformers model's output embeddings when an nn.Linear."""
    if isinstance(model, Llama):
        return model.head
    hf = hf_model(model)
    head = None if hf is None else hf.get_output_embeddings()
    return head if isinstance(head, nn.Linear) else None


def probe(model: nn.Module, *, device: torch.device, packed: bool = False) -> HeadLossProbe:
    """Whether the chunked loss reproduces `model`'s loss (module docstring); the verdict is kept per model.

    A transformers model is run once without gradients (on a sharded model every rank must call it at
    the same point), on the packing probe's shape and, for `packed` rows, its position_ids: a compiled
    attention that specialises on shapes and masks (flex_attention) then compiles nothing the packing
    probe did not. A packed model is checked to keep its documents apart first (its own refusal)."""
    known = _PROBES.get(model)
    if known is not None:
        return known
    hf = hf_model(model)
    name = type(model if hf is None else hf).__name__
    head = output_head(model)
    if isinstance(model, Llama):
        takes_labels = "labels" in inspect.signature(model.forward).parameters
        verdict = HeadLossProbe(name=name, reason=None if takes_labels else "its forward takes no labels")
    elif head is None:
        verdict = HeadLossProbe(name=name, reason="its output head is not an nn.Linear")
    else:
        ids = torch.zeros(PROBE_SHAPE, dtype=torch.long, device=device)
        positions = None
        if packed:
            check_packing_supported(model, device=device)
            positions = probe_positions(device=device)
        with torch.no_grad():
            try:
                head_loss_sum(model, ids, labels=ids, position_ids=positions, checked=False)
                verdict = HeadLossProbe(name=name)
            except (_LogitsChanged, ValueError, IndexError) as failed:  # e.g. a model that indexes its logits
                verdict = HeadLossProbe(name=name, reason=str(failed).split("; ")[0])
    _PROBES[model] = verdict
    return verdict


class _LogitsChanged(ValueError):
    pass


def head_loss_sum(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None,
    checked: bool = True,
) -> torch.Tensor:
    """The fp32 cross-entropy of `model` on `input_ids`, summed over `labels` (already shifted, -100
    where nothing trains), through `st.chunked_cross_entropy`. `position_ids`: packed rows
    (train/packed.py). `checked`: refuse a model `probe` refused (probing it first if need be)."""
    if checked:
        verdict = probe(model, device=input_ids.device, packed=position_ids is not None)
        if verdict.reason is not None:
            raise ValueError(verdict.refusal())
    if position_ids is not None:
        check_packing_supported(model, device=input_ids.device)  # its probe needs the real head
    if isinstance(model, Llama):
        return (
            model(input_ids, labels=labels)
            if position_ids is None
            else model(input_ids, position_ids=position_ids, labels=labels)
        )
    head = output_head(model)
    with head_returns_loss(head, labels) as returned:
        out = forward_logits(model, input_ids, position_ids=position_ids)
    if len(returned) != 1 or out is not returned[0]:
        what = (
            f"calls its output head {len(returned)} times"
            if len(returned) != 1
            else "changes its logits after the head"
        )
        raise _LogitsChanged(f"{type(hf_model(model)).__name__} {what}; {_FIX}")
    return out
