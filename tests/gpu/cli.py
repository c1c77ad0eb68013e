"""`shardtrain train` in a fresh process on the GPU, and the records it writes: the GPU tests' launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def train(*args: str, out_dir: Path, name: str, timeout: float = 300) -> str:
    """Run `python -m shardtrain train` on one CUDA device with `args`; return its stdout, or fail with
    the end of its output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "shardtrain", "train", "--engine.accelerator", "cuda", "--engine.devices", "1"]
    command += ["--run.progress", "false", "--run.out_dir", str(out_dir), "--run.name", name, *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert run.returncode == 0, f"{' '.join(command)}\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    return run.stdout


def records(run_dir: Path, kind: str) -> list[dict]:
    """The run's metrics.jsonl records of one kind ("train", "eval", "summary")."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]
