"""`st.clip_grad_norm_`'s global norm is at least as exact as torch's `clip_grad_norm_` over the same
unsharded gradients, against a float64 norm, whatever the sharding; and clipping scales by it."""

import math
import statistics
from pathlib import Path

import pytest
import torch

from tests.gpu.scripts import run_script
from tests.ops.grad_norm_ranks import norm_errors

SEEDS = range(5)
BOUND = 2e-6  # relative error of the fp32 norm against float64


@pytest.mark.parametrize(("world", "strategy"), [(1, "full_shard"), (2, "full_shard"), (2, "no_shard")])
def test_global_norm_is_as_exact_as_torch(pools, world, strategy):
    runs = pools(world).run(norm_errors, strategy, list(SEEDS))[0]
    for norm_type in (2.0, 1.0):
        ours = [r[norm_type]["ours"] for r in runs]
        theirs = [r[norm_type]["torch"] for r in runs]
        summary = f"norm_type {norm_type}: ours {ours}, torch's {theirs}"
        assert max(ours) <= BOUND, summary
        assert all(o <= t for o, t in zip(ours, theirs)), summary
        assert statistics.median(ours) <= statistics.median(theirs), summary
    for r in runs:
        assert r[math.inf]["ours"] == 0.0, r  # a max is exact (float32 of the float64 max)
        assert r["clip_scaled_exactly"], r
        assert r["clipped_norm"] == pytest.approx(1.0, rel=BOUND), r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_global_norm_on_cuda_with_host_gradients():
    out = run_script(Path(__file__).parent / "grad_norm_gpu.py", nproc=1, port=29647)
    assert "grad norm on CUDA: ok" in out
