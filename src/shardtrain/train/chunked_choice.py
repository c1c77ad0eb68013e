"""train.chunked_loss: whether the run's loss goes through train/head_loss.py's chunks.

true: always (refused up front under tensor parallelism, and for a model the chunks cannot follow);
false: never (the full logits, as before); auto: where the memory estimator prices the chunked loss
below the full logits for the run's micro-batch (`planning.cost.activations.chunked_loss_wins`: at every
length when the head is frozen, as under LoRA), for a model the chunks follow, without tensor
parallelism. On the CPU and on CUDA alike: the chunks do the same arithmetic as the full logits.
"""

from __future__ import annotations

from torch import nn

from ..engine import Engine
from ..planning.cost.activations import chunked_loss_wins
from .head_loss import output_head, probe
from .sections import Config


def check_chunked_loss_config(cfg: Config) -> None:
    """ValueError for train.chunked_loss=true under tensor parallelism (before any communication)."""
    if cfg.train.chunked_loss is True and cfg.engine.tp > 1:
        raise ValueError(
            f"train.chunked_loss=true with engine.tp={cfg.engine.tp}: the chunked loss runs on whole head weights, "
            "which tensor parallelism splits over the tp ranks; pass --train.chunked_loss false (or auto), or "
            "--engine.tp 1"
        )


def use_chunked_loss(
    cfg: Config, model: nn.Module, engine: Engine, *, micro_batch: int, packed: bool
) -> tuple[bool, str | None]:
    """(whether the run's loss is chunked, a notice for the log or None), on the sharded `model` that trains
    on `packed` rows or not; every rank calls it together (a transformers model's probe is a forward)."""
    wanted = cfg.train.chunked_loss
    if wanted is False or cfg.engine.tp > 1:
        return False, None
    verdict = probe(model, device=engine.device, packed=packed)
    if verdict.reason is not None:
        if wanted is True:
            raise ValueError(verdict.refusal())
        return False, f"the loss is computed over the full logits: for {verdict.name}, {verdict.reason}"
    if wanted is True:
        return True, None
    head = output_head(model)
    compute = engine.mixed_precision.param_dtype or head.weight.dtype
    wins = chunked_loss_wins(
        tokens=micro_batch * cfg.data.seq_len,
        dim=head.in_features,
        vocab=head.out_features,
        compute_bytes=compute.itemsize,
        head_trains=head.weight.requires_grad,
    )
    return wins, None
