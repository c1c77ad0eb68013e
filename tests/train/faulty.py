"""Model factories that misbehave on purpose, for `shardtrain train --model.name tests.train.faulty:<name>`.

Each is the built-in tiny Llama that, on one rank (or all), does something wrong at the n-th training
forward (1-based; with grad_accum 1, the n-th optimizer step).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from shardtrain.models.llama import Llama, llama_config


class _Faulty(Llama):
    _no_split_modules = ["Block"]  # shard by block, like the built-in

    def __init__(self, *, at: int, rank: int | None, **kwargs) -> None:
        super().__init__(llama_config("tiny", **kwargs))
        self.at, self.rank, self.calls = at, rank, 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = super().forward(tokens)
        if self.training:
            self.calls += 1
            if self.calls == self.at and self.rank in (None, int(os.environ.get("RANK", "0"))):
                logits = self.misbehave(logits)
        return logits


class _NaN(_Faulty):
    def misbehave(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * float("nan")


class _Sleepy(_Faulty):
    def __init__(self, *, seconds: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds

    def misbehave(self, logits: torch.Tensor) -> torch.Tensor:
        print(f"faulty: rank {self.rank} sleeps {self.seconds}s from {time.time()}", file=sys.stderr, flush=True)
        time.sleep(self.seconds)
        return logits


def nan_llama(*, at: int, rank: int | None = None, **kwargs) -> Llama:
    """NaN logits (so a NaN loss and NaN gradients) at training forward `at`."""
    return _NaN(at=at, rank=rank, **kwargs)


def sleepy_llama(*, at: int, seconds: float, rank: int | None = None, **kwargs) -> Llama:
    """Sleeps `seconds` outside any collective at training forward `at`: its peers wait for it."""
    return _Sleepy(at=at, rank=rank, seconds=seconds, **kwargs)
