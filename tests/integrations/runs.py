"""Running a framework's script in fresh processes (the framework's launcher starts the ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: str, *args: str, torchrun: bool = False, timeout: float = 240) -> dict:
    """Run `tests/integrations/<script> OUT ARGS...` from the repository root (under torchrun with 2 ranks
    when `torchrun`, else as a plain script whose framework starts the ranks); return OUT/result.json."""
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun else []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, *launcher, str(ROOT / "tests" / "integrations" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return json.loads((out / "result.json").read_text())
