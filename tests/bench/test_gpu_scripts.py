"""The one-GPU benchmark scripts, each in its CPU dry-run mode: a script that breaks costs a device call,
which is scarce, so each is run here on a tiny model and its printed results are checked.

Each test runs the script as a user does (a fresh interpreter, the checkout's `src` first on the path)
and reads the JSON lines it prints.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_script(name: str, *args: str, timeout: float = 600) -> list[dict]:
    """The JSON objects `benchmarks/<name>` prints on stdout, one per line; AssertionError with its stderr's tail."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}: {done.stderr[-3000:]}"
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def test_dpo_script_times_both_engines():
    pytest.importorskip("trl")
    (result,) = run_script("dpo_gpu.py", "--small", "--steps", "2", "--warmup", "1")
    assert result["reference"].startswith("trl "), result  # TRL's own run, not the fallback loop
    assert positive(result["shardtrain_tokens_per_s"]) and positive(result["reference_tokens_per_s"])


def test_qlora_script_trains_both_engines_on_the_ladder():
    pytest.importorskip("bitsandbytes")
    lines = run_script("qlora_gpu.py", "--device", "cpu", "--sizes", "tiny", "--seq", "64", "--steps", "2")
    runs = {line["engine"]: line for line in lines if "engine" in line}
    assert set(runs) == {"shardtrain", "peft_bnb"}
    for run in runs.values():
        assert run["fits"] and positive(run["tokens_s"]) and all(map(math.isfinite, run["losses"]))
        assert run["losses"][-1] < run["losses"][0], run  # both train
    assert lines[-1]["largest"] == {"shardtrain": "tiny", "peft_bnb": "tiny"}


def test_chunked_loss_script_compares_both_losses():
    lines = run_script("chunked_loss.py", "--smoke")
    losses = {line["loss"] for line in lines if "loss" in line}
    assert losses == {"full logits", "chunked"}
    assert positive(lines[-1]["summary"]["tokens_per_s_ratio"])


def test_streaming_script_runs_the_streamed_and_cached_fine_tunes(tmp_path):
    pytest.importorskip("datasets")
    create = "--layers 2 --hidden 128 --heads 4 --kv-heads 2 --intermediate 256 --vocab 1024"
    lines = run_script(
        "streaming_gpu.py",
        *("--work", str(tmp_path), "--device", "cpu", "--corpus-mb", "2", "--cached-mb", "1", "--seq", "256"),
        *("--steps", "3", "--warmup", "1", "--vocab", "1000", "--pool", "2000", "--num-proc", "1"),
        *("--runs", "streamed,cached", "--create", create),
    )
    runs = {line["run"]: line for line in lines}
    assert set(runs) == {"streamed", "cached"}
    for run in runs.values():
        assert 0 < run["launch_to_weights_loaded_s"] <= run["launch_to_first_step_s"], run
        assert positive(run["tokens_per_s"]) and run["data_load_s"] >= 0
        assert run["startup"]["weights_s"] >= 0 and 0 < run["startup"]["total_s"] <= run["launch_to_first_step_s"]


def test_probe_script_counts_one_compile_of_the_attention_and_its_mask():
    (line,) = run_script("probe_compiles.py", "--device", "cpu")
    assert line["compiled_frames"] == 2 and positive(line["seconds"]) and line["chunked_loss_probe"] == "accepted"
