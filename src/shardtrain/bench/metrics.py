"""The numbers a row reports: throughput statistics and model FLOPs utilisation.

MFU, as BENCHMARKS.md reports it: (6·(params − embedding) + 6·layers·dim·seq) FLOPs per token ×
tokens/s per GPU / peak FLOP/s, the peak being a stated bf16 matmul rate (790 TFLOP/s for one H200).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from ..models.llama import flops_per_token
from .spec import RunSpec

H200_PEAK_TFLOPS = 790.0
MFU_FORMULA = "(6·(params − embedding) + 6·layers·dim·seq) FLOPs/token × tokens/s/GPU / peak"


@dataclass(frozen=True, kw_only=True)
class Stats:
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats:
        values = list(values)
        if not values:
            raise ValueError("Stats.of needs at least one value")
        return cls(median=statistics.median(values), min=min(values), max=max(values))

    def to_dict(self) -> dict:
        return asdict(self)


def model_flops_per_token(spec: RunSpec) -> float:
    """Training FLOPs per token of the spec's model at the spec's sequence length."""
    return flops_per_token(spec.model_config(), spec.seq)


def mfu(*, flops_per_token: float, tokens_per_s_per_gpu: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation, a fraction of `peak_tflops` (TFLOP/s per GPU)."""
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops={peak_tflops} must be positive")
    return flops_per_token * tokens_per_s_per_gpu / (peak_tflops * 1e12)


def tokens_per_second(*, tokens_per_step: int, step_ms: Iterable[float]) -> list[float]:
    """Per-step throughput of one rank from its step times."""
    return [tokens_per_step * 1000.0 / ms for ms in step_ms]
