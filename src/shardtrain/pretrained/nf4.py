"""A frozen `nn.Linear` whose weight is stored in 4 bits: torchao's NF4 with double-quantised scales.

torchao quantises (`to_nf4`); this module keeps the four tensors of the result as separate frozen
parameters, so the engine shards each by rows like any frozen parameter, a row of the packed codes
being one whole block of 64 values (the layout: docs/design.md, Note [NF4 layout]). `forward`
dequantises the gathered weight (`dequantize`, torchao's `get_original_weight` bit for bit) and
multiplies; backward dequantises it again instead of keeping it, so a layer's 16-bit weight lives
only while it computes (docs/design.md, "QLoRA: a 4-bit base through the ordinary frozen-parameter path").
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

BLOCK = 64  # values per quantisation block (torchao's and bitsandbytes' default)
SCALER_BLOCK = 256  # blocks per group of the double-quantised scales
COMPONENTS = ("weight_nf4", "weight_scalers", "weight_factor", "weight_mean")


@contextlib.contextmanager
def quiet_torchao() -> Iterator[None]:
    """Imports of torchao (peft imports it too, when installed) without its import-time warnings: its CUDA
    kernels fail to load on a CPU-only torch, and torch deprecates how it registers two enums; neither
    concerns its NF4 tensor."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def torchao_nf4():
    """torchao's `to_nf4`, imported on first use (its import takes seconds), with a clear error without it."""
    try:
        with quiet_torchao():
            from torchao.quantization import to_nf4
    except ModuleNotFoundError as exc:
        raise ValueError("a 4-bit base (QLoRA) needs torchao: pip install 'shardtrain[qlora]'") from exc
    return to_nf4


def quantizable(linear: nn.Module) -> bool:
    """Whether `linear` is an `nn.Linear` whose weight fills whole blocks of 64 values (every real model's)."""
    return type(linear) is nn.Linear and linear.in_features * linear.out_features % BLOCK == 0


def scaler_block(n_blocks: int) -> int:
    """Blocks per group of scales: 256, or for a small weight the largest power of two dividing its blocks."""
    return math.gcd(n_blocks, SCALER_BLOCK)


class NF4Linear(nn.Module):
    """`y = x W^T + b` with W frozen in NF4 (module docstring); built from the `nn.Linear` it replaces."""

    def __init__(
        self,
        *,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        n_blocks = in_features * out_features // BLOCK
        self.scaler_block_size = scaler_block(n_blocks)

        def frozen(*shape: int, kind: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=kind, device=device), requires_grad=False)

        self.weight_nf4 = frozen(n_blocks, BLOCK // 2, kind=torch.uint8)
        self.weight_scalers = frozen(n_blocks, kind=torch.int8)
        self.weight_factor = frozen(n_blocks // self.scaler_block_size, kind=dtype)
        self.weight_mean = frozen(kind=dtype)
        self.bias = frozen(out_features, kind=dtype) if bias else None

    @classmethod
    def replacing(cls, linear: nn.Linear) -> NF4Linear:
        """An NF4Linear of `linear`'s shape and dtype, on its device (meta: nothing allocated), bias shared."""
        out = cls(
            in_features=linear.in_features,
            out_features=linear.out_features,
            bias=False,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
        )
        if linear.bias is not None:
            out.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        return out

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weight was quantised from and dequantises to."""
        return self.weight_factor.dtype

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, NF4"

    @torch.no_grad()
    def quantize_from(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """`weight` ([out, in], any float dtype) quantised by torchao: the four components, whole, by name."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(weight.shape)} for an NF4Linear of {self.extra_repr()}")
        q = torchao_nf4()(weight.to(self.dtype).contiguous(), BLOCK, self.scaler_block_size)
        return {
            "weight_nf4": q.quantized_data.view(-1, BLOCK // 2),
            "weight_scalers": q.quantized_scalers,
            "weight_factor": q.quantization_factor,
            "weight_mean": q.scaler_mean,
        }

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """What `nn.Linear.reset_parameters` draws (Kaiming-uniform weight and uniform bias), quantised: the
        initialisation `st.shard` gives a model built on the meta device, one layer's weight at a time."""
        weight = torch.empty(self.out_features, self.in_features, dtype=self.dtype, device=self.weight_nf4.device)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        for name, value in self.quantize_from(weight).items():
            getattr(self, name).copy_(value)
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def components(self) -> tuple[torch.Tensor, ...]:
        """The four tensors as forward sees them (inside a sharded unit: the gathered views)."""
        return tuple(getattr(self, name) for name in COMPONENTS)

    def dequantized(self) -> torch.Tensor:
        return dequantize(*self.components(), shape=(self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.out_features, self.in_features)
        y = _NF4Matmul.apply(x, shape, *self.components())
        return y if self.bias is None else y + self.bias.to(y.dtype)


def dequantize(
    data: torch.Tensor, scalers: torch.Tensor, factor: torch.Tensor, mean: torch.Tensor, *, shape: tuple[int, int]
) -> torch.Tensor:
    """The weight the four components encode, in the factor's dtype (torchao's arithmetic, module docstring).

    Each byte indexes a table of the 256 pairs of levels it encodes, so the codes are read in one
    gather of the bytes, not one per nibble.
    """
    dtype = factor.dtype
    scales = (scalers.view(factor.numel(), -1) / factor.unsqueeze(-1)).flatten().to(dtype) + mean
    values = _pair_table(dtype, data.device)[data.int()]  # [n_blocks, 32, 2]
    return (values.view(data.shape[0], -1) * scales.unsqueeze(-1)).view(shape)


_compiled: Callable[..., torch.Tensor] | None = None


def compile_dequantize(enabled: bool = True) -> None:
    """Dequantise every NF4 layer through `torch.compile` (one fused kernel, dynamic shapes: one compilation
    for every weight) instead of the eager gather and multiply. Off by default: the compilation takes
    tens of seconds, and the fused kernel may round the scales' arithmetic once instead of per operation."""
    global _compiled
    _compiled = torch.compile(dequantize, dynamic=True) if enabled else None


def _dequantizer() -> Callable[..., torch.Tensor]:
    return _compiled or dequantize


@functools.cache
def _pair_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2]: the NF4 levels (torchao's table, in `dtype`) of a byte's high and low nibble."""
    levels = torchao_nf4()(torch.zeros(BLOCK, dtype=dtype), BLOCK, 1).nf4
    codes = torch.arange(256)
    return torch.stack((levels[codes >> 4], levels[codes & 15]), dim=-1).to(device)


class _NF4Matmul(torch.autograd.Function):
    """`x @ W^T` for the NF4 weight: saves the (gathered) components, not the dequantised weight, and
    dequantises again in backward. The weight is frozen: only `x` gets a gradient."""

    @staticmethod
    def forward(ctx, x, shape, *parts):
        ctx.shape = shape
        ctx.save_for_backward(*parts)
        return x @ _dequantizer()(*parts, shape=shape).to(x.dtype).T

    @staticmethod
    def backward(ctx, grad):
        weight = _dequantizer()(*ctx.saved_tensors, shape=ctx.shape).to(grad.dtype)
        return grad @ weight, None, None, None, None, None
