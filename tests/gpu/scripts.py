"""Running a GPU test's script in fresh processes: torchrun's ranks, or one plain process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(
    script: Path,
    *args: str,
    nproc: int | None = None,
    port: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> str:
    """Run `script ARGS...` with this checkout's sources first on the path, under torchrun with `nproc`
    ranks (on `port`, else torchrun's default) when given; assert that it exits 0; return its stdout."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    launcher = []
    if nproc is not None:
        launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        launcher += [f"--master_port={port}"] if port is not None else []
    out = subprocess.run(
        [sys.executable, *launcher, str(script), *args],
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout
