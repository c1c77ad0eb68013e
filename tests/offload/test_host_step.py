"""The overlapped host step (offload/host_step.py) trains bit for bit like the user's sequential step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.offload.host_step_ranks import (
    falls_back_once,
    in_backward_error,
    in_backward_falls_back,
    overlapped_equals_sequential,
)


@pytest.mark.parametrize("clip", [False, True], ids=["steps_in_backward", "clipping_falls_back"])
def test_overlapped_step_is_bitwise_the_sequential_step(pools, tmp_path, clip):
    """Fused AdamW, 10 steps of 4 micro-batches (3 under st.no_sync), a checkpoint and resume with steps
    pending, a 50 ms sleep in every unit's step, CPUOffload(step_in_backward=True). Without clipping
    every unit steps during backward (but before the first step() and after the resume); with clipping
    that fires on some steps and an inf step the guard skips, the units step after backward, with one
    warning naming the clipping."""
    assert pools(2).run(overlapped_equals_sequential, str(tmp_path), "adamw_fused", 10, True, True, clip)[0] > 0


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("accumulate", "2 synchronising backwards came before step() (accumulate under st.no_sync)"),
        ("torch_clip", "the gradients were changed in place between backward and step()"),
    ],
)
def test_in_backward_step_falls_back_for_what_the_loop_shows(pools, case, message):
    for messages in pools(2).run(in_backward_falls_back, case):
        assert len(messages) == 1 and message in messages[0], messages


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("clip", "st.clip_grad_norm_ found the norm"),
        ("torch_clip", "the gradients were changed in place after they stepped"),
        ("skip", "zero_grad() came before the optimizer.step() that they belong to (a skipped step"),
        ("lr", "param group 0's 'lr' is"),
    ],
)
def test_in_backward_step_that_cannot_be_exact_raises(pools, case, message):
    for error in pools(2).run(in_backward_error, case):
        assert message in error and "set st.CPUOffload(step_in_backward=False)" in error, error


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw_fused", "adam_foreach", "sgd"])
def test_overlapped_after_backward(pools, tmp_path, optim):
    """step_in_backward off: every step after backward, gradients accumulated into .grad (no no_sync),
    clipping that fires on some steps, an inf step the guard skips; fused AdamW also resumes."""
    fused = optim == "adamw_fused"
    assert pools(2).run(overlapped_equals_sequential, str(tmp_path), optim, 7 if fused else 5, fused)[0] > 0


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
        [*command, str(root / "tests" / "offload" / "host_step_gpu.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "host step on CUDA: ok" in out.stdout
