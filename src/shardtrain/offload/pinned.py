"""Page-locked host buffers of exactly the requested size, for offloaded shards and gradients.

torch's pinned allocator (`pin_memory=True`) rounds every allocation up to a power of two: a 780 MB
shard occupies 1 GiB (the effect on host memory: BENCHMARKS.md, 'CPU offload and the largest model
that trains (2 × H200)'). `PinnedBuffers` allocates ordinary host memory of the exact size
and page-locks it with `cudaHostRegister`, so host-to-device copies stay asynchronous at no extra
memory. It keeps every buffer alive while it lives and unregisters them all when it is collected
(with the model that owns it), so no page is ever freed while registered.
"""

from __future__ import annotations

import warnings
import weakref

import torch


class PinnedBuffers:
    """Exact-size pinned host tensors; `empty(shape, dtype)` hands one out."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._registered: list[int] = []  # data pointers to unregister
        weakref.finalize(self, _unregister, self._registered)

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        if tensor.numel() == 0:
            return tensor
        error = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0))
        if error:
            warnings.warn(
                f"cudaHostRegister failed (CUDA error {error}) for {tensor.numel() * tensor.element_size()} "
                "bytes; using torch's pinned allocator, which rounds sizes up to a power of two",
                RuntimeWarning,
                stacklevel=2,
            )
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        self._buffers.append(tensor)
        self._registered.append(tensor.data_ptr())
        return tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers)


def _unregister(pointers: list[int]) -> None:
    # Note: runs while the buffers are still referenced (the owner's attributes are cleared after its
    # weak references fire), so the pages are unlocked before they can be freed.
    for pointer in pointers:
        torch.cuda.cudart().cudaHostUnregister(pointer)
    pointers.clear()
