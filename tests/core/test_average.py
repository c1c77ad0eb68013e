"""The fused gradient average: the same values as torch's mean, exact for two ranks."""

import pytest
import torch

from shardtrain.core import average


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_average_matches_mean(ranks):
    received = torch.randn(ranks, 1000).bfloat16()
    expected = received.mean(dim=0, dtype=torch.float32)
    got = average.average_received(received, torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    fused_formula = average._widen_and_average(received, torch.float32)
    if ranks in (2, 4):  # 1/ranks is a power of two: the fused formula is the exact mean
        assert torch.equal(fused_formula, expected)


def test_failed_compile_warns_and_uses_torch(monkeypatch):
    class Broken:
        def __call__(self, *args):
            raise RuntimeError("no triton")

    monkeypatch.setattr(average, "_compiled", lambda: Broken())
    monkeypatch.setattr(average, "_fused_available", True)
    with pytest.warns(UserWarning, match="fused gradient average"):
        average.prepare(torch.device("cuda"), 2)  # the kernel is built (and fails) before any tensor is made
    assert average._fused_available is False
