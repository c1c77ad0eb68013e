"""PinnedBuffers: exact sizes, registered once, unregistered when the owner goes (CUDA runtime faked)."""

import gc

import pytest
import torch

from shardtrain.offload.pinned import PinnedBuffers


class FakeCudart:
    def __init__(self, fail: bool = False):
        self.registered: dict[int, int] = {}
        self.fail = fail

    def cudaHostRegister(self, pointer, nbytes, flags):
        if self.fail:
            return 2
        self.registered[pointer] = nbytes
        return 0

    def cudaHostUnregister(self, pointer):
        del self.registered[pointer]
        return 0


def test_exact_sizes_registered_and_released(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buffers = PinnedBuffers()
    shard = buffers.empty((195_000_001,), torch.float32)  # not a power of two: no rounding up
    grad = buffers.empty(torch.Size([3, 5]), torch.float32)
    assert shard.shape == (195_000_001,) and grad.shape == (3, 5) and grad.dtype == torch.float32
    assert sorted(cudart.registered.values()) == [60, 780_000_004]
    assert buffers.nbytes == 780_000_064
    del buffers
    gc.collect()
    assert cudart.registered == {}  # unlocked with the owner; the tensors themselves stay usable
    shard[0] = 1.0


def test_failed_registration_warns_and_falls_back(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(fail=True))
    fallback = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        fallback.append(pin_memory)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.warns(RuntimeWarning, match="cudaHostRegister failed.*power of two"):
        PinnedBuffers().empty((8,), torch.float32)
    assert fallback == [False, True]
