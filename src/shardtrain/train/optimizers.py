"""The main job's optimizer (`--optim.name`), built on the unsharded model before `Engine.setup`.

Every choice is torch's optimizer: AdamW (fused on CUDA) and SGD step the sharded rows elementwise;
Adafactor and Muon read whole matrices and step each parameter as a whole tensor
(whole_tensor_step.py), so the sharded run updates as one process would. torchao's low-bit AdamW
(adamw8bit, adamw4bit) is refused by the configuration with the reason (sections.py).

Muon orthogonalizes 2-D hidden matrices only; embeddings, the output head and 1-D parameters step
with AdamW, as the usual recipe does: `MuonWithAdamW` is one optimizer whose param groups say which
rule steps them, so the engine, the scheduler and checkpoints see one optimizer. Muon's learning
rate is scaled to AdamW's update size (torch's `adjust_lr_fn="match_rms_adamw"`), so one `optim.lr`
and one schedule serve both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .sections import OptimConfig
from .whole_tensor_step import AdafactorWhole, MuonWhole

OPTIMIZER_NAMES = ("adamw", "sgd", "adafactor", "adamw8bit", "adamw4bit", "muon")


def weight_decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on matrices, none on norms, biases and other vectors (by shape, which sharded
    parameters keep)."""
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_optimizer(optim: OptimConfig, model: nn.Module, *, device: torch.device) -> torch.optim.Optimizer:
    """`optim.name`'s optimizer over `model`'s trainable parameters (frozen ones get no state)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = weight_decay_groups(trainable, optim.weight_decay)
    betas = (optim.beta1, optim.beta2)
    if optim.name == "adamw":
        return torch.optim.AdamW(groups, lr=optim.lr, betas=betas, fused=device.type == "cuda")
    if optim.name == "sgd":
        momentum = 0.9 if optim.momentum is None else optim.momentum
        return torch.optim.SGD(groups, lr=optim.lr, momentum=momentum, nesterov=bool(optim.nesterov))
    if optim.name == "adafactor":
        return AdafactorWhole(groups, lr=optim.lr)
    return MuonWithAdamW(
        muon_groups(model, trainable, optim.weight_decay),
        lr=optim.lr,
        betas=betas,
        momentum=0.95 if optim.momentum is None else optim.momentum,
        nesterov=True if optim.nesterov is None else optim.nesterov,
    )


def muon_groups(model: nn.Module, trainable: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Muon's hidden matrices (2-D weights of linear layers other than the output head and anything tied
    to an embedding) and AdamW's rest (embeddings, the head, vectors), each with its weight decay."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hidden = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, nn.Linear) and m is not head and type(m).__name__ != "OutputHead"
    }
    muon = [p for p in trainable if p.ndim == 2 and id(p) in hidden and id(p) not in embedded]
    chosen = {id(p) for p in muon}
    rest = [p for p in trainable if id(p) not in chosen]
    return [
        {"params": muon, "muon": True, "weight_decay": weight_decay},
        *({**g, "muon": False} for g in weight_decay_groups(rest, weight_decay)),
    ]


class MuonWithAdamW(torch.optim.Optimizer):
    """torch's Muon on the groups marked `muon`, torch's AdamW on the others, as one optimizer: one
    state and one list of param groups (what schedulers and checkpoints read). Each `step()` hands the
    inner optimizers their current groups and the shared state, so a loaded state dict (which
    replaces both) steps as saved."""

    def __init__(
        self, groups: list[dict], *, lr: float, betas: tuple[float, float], momentum: float, nesterov: bool
    ) -> None:
        for_muon = [g for g in groups if g["muon"] and g["params"]]
        for_adamw = [g for g in groups if not g["muon"] and g["params"]]
        self._muon = MuonWhole(
            for_muon or [{"params": [], "muon": True}],
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            adjust_lr_fn="match_rms_adamw",
        )
        self._adamw = torch.optim.AdamW(for_adamw or [{"params": [], "muon": False}], lr=lr, betas=betas)
        super().__init__(
            [g for g in (*self._muon.param_groups, *self._adamw.param_groups) if g["params"]], defaults={"lr": lr}
        )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner, marked in ((self._muon, True), (self._adamw, False)):
            inner.param_groups = [g for g in self.param_groups if g["muon"] is marked]
            inner.state = self.state
            if inner.param_groups:
                inner.step()
        return loss
