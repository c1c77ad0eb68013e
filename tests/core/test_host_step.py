"""The overlapped host step (core/host_step.py) trains bit for bit like the user's sequential step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.core.host_step_ranks import falls_back_once, overlapped_equals_sequential


def test_overlapped_step_is_bitwise_the_sequential_step(pools, tmp_path):
    """Fused AdamW, 10 steps of 4 micro-batches, clipping that fires on some steps, an inf step the
    guard skips, a checkpoint and resume with steps pending, a 50 ms sleep in every unit's step."""
    assert pools(2).run(overlapped_equals_sequential, str(tmp_path), "adamw_fused", 10, True)[0] > 0


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adam_foreach", "sgd"])
def test_other_splittable_optimizers(pools, tmp_path, optim):
    assert pools(2).run(overlapped_equals_sequential, str(tmp_path), optim, 5, False)[0] > 0


@pytest.mark.parametrize(
    ("optim", "reason"), [("adagrad", "Adagrad cannot be stepped per unit"), ("adamw_fused", "closure")]
)
def test_unsplittable_step_falls_back_with_one_warning(pools, optim, reason):
    for messages in pools(2).run(falls_back_once, optim):
        assert len(messages) == 1 and reason in messages[0], messages


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_units_on_cuda(tmp_path):
    """The real path: offloaded shards in pinned memory, steps deferred by st.shard, copies to the GPU."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port=29645"]
    out = subprocess.run(
        [*command, str(root / "tests" / "core" / "host_step_gpu.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "host step on CUDA: ok" in out.stdout
