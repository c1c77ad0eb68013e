"""Every torch.compile form on one GPU (inductor, bf16) trains like eager: tests/gpu/compile_forms.py."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_compile_form_matches_eager_on_the_gpu():
    script = os.path.join(os.path.dirname(__file__), "compile_forms.py")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
