"""Which blocks activation checkpointing recomputes: every block, or 1 in k, never the embedding or head."""

from __future__ import annotations

from typing import Any

from torch import nn

from ...core.partition import matching_paths, repeated_blocks
from .inputs import recompute_every_of


def recompute_policy(model: nn.Module, *, wrap: Any, every: bool | int) -> Any:
    """The `activation_checkpointing=` policy for checkpointing 1 in `every` of the model's blocks.

    The blocks are the modules `wrap` selects whose class occurs more than once among them (all of
    them when none repeats): a wrap with the embedding and the output head as units of their own
    (`models.llama.SHARD_UNITS`) does not checkpoint those — the head would recompute its large
    matmul and a checkpointed embedding cannot look its rows up sharded. 0 / False: None; 1 / True:
    every block; k >= 2: the blocks at positions 0, k, 2k, ... in module order (the blocks
    estimate_memory counts for recompute_every=k).
    """
    every = recompute_every_of(every)
    if every == 0:
        return None
    paths = matching_paths(model, wrap, what="wrap")
    selected = [m for path, m in model.named_modules() if path in paths]
    blocks = repeated_blocks(selected)
    if every == 1 and len(blocks) == len(selected):
        return wrap
    chosen = {id(m) for m in blocks[::every]}

    def checkpointed(module: nn.Module) -> bool:
        return id(module) in chosen

    return checkpointed
