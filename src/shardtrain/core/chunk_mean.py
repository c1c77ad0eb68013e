"""The narrow wire's arithmetic: the mean, in the reduction dtype, of the W chunks an exchange delivered.

On CUDA it is one Triton kernel: each element read once per chunk, widened, summed and scaled, then
written once, at about the bandwidth floor of its bytes. torch's `mean(dim=0, dtype=...)` over the
`(W, n)` view computes the same values with a general reduction kernel that runs well above that
floor, and it runs beside the compute stream, which waits for the SMs it holds (timings:
BENCHMARKS.md, 'Tried and rejected'). Elsewhere (CPU, or no Triton) torch's mean does it.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

_BLOCK = 4096


def mean_of_chunks(received: torch.Tensor, chunks: int, dtype: torch.dtype) -> torch.Tensor:
    """The elementwise mean of `received`'s `chunks` equal consecutive chunks, as a new `dtype` tensor.

    Note: the sum is taken in `dtype` in chunk order, then scaled by 1/chunks; with two chunks of bf16
    values widened to fp32 both steps are exact, so the two paths agree bit for bit.
    """
    if received.is_cuda and dtype == torch.float32 and _triton_kernel() is not None:
        n = received.numel() // chunks
        out = torch.empty(n, dtype=dtype, device=received.device)
        _triton_kernel()[(_cdiv(n, _BLOCK),)](received, out, n, 1.0 / chunks, CHUNKS=chunks, BLOCK=_BLOCK, num_warps=8)
        return out
    return received.view(chunks, -1).mean(dim=0, dtype=dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _triton_kernel():
    if importlib.util.find_spec("triton") is None:
        return None
    import triton
    import triton.language as tl

    @triton.jit
    def mean_chunks(src, out, n, scale, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        at = src + offs
        acc = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        for _ in tl.static_range(1, CHUNKS):
            at += n  # Note: step the pointers chunk by chunk; n itself may be a 32-bit (or constant) integer
            acc += tl.load(at, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + offs, acc * scale, mask=mask)

    return mean_chunks
