"""st.load_pretrained with cpu_offload (shards in pinned host memory), which only a CUDA device honours."""

import pytest
import torch

from tests.gpu.scripts import ROOT, run_script

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loads_into_offloaded_shards(hf_folders):
    out = run_script(ROOT / "tests" / "pretrained" / "offload_gpu.py", str(hf_folders["llama_tied"]))
    assert "offload loads: ok" in out
