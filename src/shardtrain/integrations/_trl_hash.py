"""TRL's `hash_module` for a sharded model: the key of `DPOTrainer`'s precomputed reference log-probabilities.

With `precompute_ref_log_probs=True`, `DPOTrainer.__init__` fingerprints the reference model (the policy,
under the mixin already sharded) by hashing every tensor of its `state_dict()` through `.numpy()`, which
DTensors refuse. While a mixin trainer is built, `trl.trainer.dpo_trainer.hash_module` is swapped for one
that hashes a sharded model's local rows on each rank (names, dtypes and global shapes included) and then
the list of every rank's digest, gathered: one value, the same on every rank, that changes with any row
of any rank. Unsharded models keep TRL's own hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..core.sharded_param import local_of
from ._frozen import is_sharded

_TRL_MODULE = "trl.trainer.dpo_trainer"


def hash_sharded(module: nn.Module, fallback: Callable[[nn.Module], str]) -> str:
    """The hex digest of `module`'s weights on every rank (a collective when sharded), else `fallback(module)`."""
    if not is_sharded(module):
        return fallback(module)
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        rows = local_of(tensor).detach().cpu()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(rows.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest.hexdigest())
    return hashlib.sha256("".join(str(d) for d in digests).encode()).hexdigest()


@contextlib.contextmanager
def sharded_hashing() -> Iterator[None]:
    """Within: TRL's DPO trainer hashes a sharded model with `hash_sharded` (no effect when TRL is not loaded)."""
    trl_module = sys.modules.get(_TRL_MODULE)
    original = getattr(trl_module, "hash_module", None)
    if original is None:
        yield
        return
    trl_module.hash_module = lambda module: hash_sharded(module, original)
    try:
        yield
    finally:
        trl_module.hash_module = original
