"""The GPU tests' launcher: a script in fresh processes (torchrun's ranks, or one plain process), and
`shardtrain train` in a fresh process on one GPU with the records it writes."""

from __future__ import annotations

import json
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
    launcher = []
    if nproc is not None:
        launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        launcher += [f"--master_port={port}"] if port is not None else []
    return _run([sys.executable, *launcher, str(script), *args], env=env or {}, timeout=timeout)


def _run(command: list[str], *, env: dict[str, str], timeout: float, cwd: Path | None = None) -> str:
    """Run `command` with this checkout's sources first on the path; assert that it exits 0 (else fail
    with the command and the end of its output); return its stdout."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run(
        command,
        env={**os.environ, "PYTHONPATH": path, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    assert out.returncode == 0, f"{' '.join(command)}\n{out.stdout[-4000:]}\n{out.stderr[-5000:]}"
    return out.stdout


def train(*args: str, out_dir: Path, name: str, timeout: float = 300) -> str:
    """Run `python -m shardtrain train` on one CUDA device with `args`; return its stdout, or fail with
    the end of its output."""
    command = ["-m", "shardtrain", "train", "--engine.accelerator", "cuda", "--engine.devices", "1"]
    command += ["--run.progress", "false", "--run.out_dir", str(out_dir), "--run.name", name, *args]
    return _run([sys.executable, *command], env={}, timeout=timeout, cwd=ROOT)


def records(run_dir: Path, kind: str) -> list[dict]:
    """The run's metrics.jsonl records of one kind ("train", "eval", "summary")."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]
