"""st.load_pretrained with cpu_offload (shards in pinned host memory), which only a CUDA device honours."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loads_into_offloaded_shards(hf_folders):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "pretrained" / "offload_gpu.py"), str(hf_folders["llama_tied"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "offload loads: ok" in out.stdout
