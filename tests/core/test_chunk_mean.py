"""The narrow wire's mean (core/chunk_mean.py): exact for two bf16 chunks, the same on CPU and in Triton."""

import pytest
import torch

from shardtrain.core.chunk_mean import mean_of_chunks


def _chunks(chunks: int, n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(chunks * n)
    return torch.randn(chunks * n, generator=g).mul_(1e3).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_chunks_average_exactly(dtype):
    received = _chunks(2, 1001, dtype, "cpu")
    a, b = received.view(2, -1).double()
    assert torch.equal(mean_of_chunks(received, 2, torch.float32).double(), (a + b) / 2)


def test_three_chunks_match_torch_mean():
    received = _chunks(3, 999, torch.bfloat16, "cpu")
    out = mean_of_chunks(received, 3, torch.float32)
    torch.testing.assert_close(out, received.view(3, -1).float().mean(dim=0), rtol=1.3e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 4095, 4097, 3 * 4096 + 5])
def test_triton_kernel_matches_torch(chunks, n):
    received = _chunks(chunks, n, torch.bfloat16, "cuda")
    out = mean_of_chunks(received, chunks, torch.float32)
    expected = received.view(chunks, -1).mean(dim=0, dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (n,)
    if chunks == 2:  # one sum of two widened bf16 values, halved: exact
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=1.3e-6, atol=0)
