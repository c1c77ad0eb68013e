"""The parity matrix on CUDA with NCCL, in fresh torchrun processes (needs 2 GPUs)."""

from pathlib import Path

import pytest
import torch

from tests.gpu.scripts import run_script

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_parity():
    env = dict(
        CUBLAS_WORKSPACE_CONFIG=":4096:8",
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
    )
    out = run_script(Path(__file__).parent / "nccl_parity.py", nproc=2, env=env, timeout=600)
    assert " 0 failed on 2 GPUs" in out
