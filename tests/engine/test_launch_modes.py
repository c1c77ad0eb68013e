"""The two ways a user's script starts: plainly (the Engine re-runs it per device) and under torchrun."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_engine.py"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(30):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 40)
    return root


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _example_args(corpus: Path, tmp_path: Path) -> list[str]:
    return [
        str(EXAMPLE),
        "--size",
        "tiny",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--accelerator",
        "cpu",
        "--data",
        str(corpus),
        "--cache-dir",
        str(tmp_path / "cache"),
    ]


def _loss_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("step")]


@pytest.mark.slow
def test_plain_run_relaunches_itself_and_matches_torchrun(corpus, tmp_path):
    plain = _run([sys.executable, *_example_args(corpus, tmp_path)])
    assert plain.returncode == 0, plain.stderr
    assert "done: 2 ranks on cpu" in plain.stdout
    torchrun = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            *_example_args(corpus, tmp_path),
        ]
    )
    assert torchrun.returncode == 0, torchrun.stderr
    assert "done: 2 ranks on cpu" in torchrun.stdout
    assert _loss_lines(plain.stdout) == _loss_lines(torchrun.stdout) != []


@pytest.mark.slow  # end to end in fresh processes; test_engine.py's spawn-mode failure covers the launcher
def test_a_failing_rank_stops_the_relaunched_job(corpus, tmp_path):
    result = _run([sys.executable, *_example_args(corpus, tmp_path), "--size", "no-such-size"], timeout=60)
    assert result.returncode != 0
    assert "unknown Llama size 'no-such-size'" in result.stderr
    assert "launcher: rank" in result.stderr and "exited with code 1" in result.stderr
