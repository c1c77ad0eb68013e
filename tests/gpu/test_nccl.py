"""The parity matrix on CUDA with NCCL, in fresh torchrun processes (needs 2 GPUs)."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_parity():
    script = os.path.join(os.path.dirname(__file__), "nccl_parity.py")
    env = dict(
        os.environ,
        CUBLAS_WORKSPACE_CONFIG=":4096:8",
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
    )
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert " 0 failed on 2 GPUs" in out.stdout
