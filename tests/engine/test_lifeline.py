"""Ranks die with their launcher: SIGKILL `shardtrain train` (or torchrun's agent) and every rank is
gone within seconds, instead of training on with nobody to collect it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from shardtrain.engine import lifeline
from tests.train.test_cli import ROOT, TINY, _on_one_file

EXIT_WITHIN_S = 5.0


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], timeout: float) -> float:
    """Seconds until every pid has exited; fails past `timeout`."""
    start = time.monotonic()
    while not all(_gone(p) for p in pids):
        assert time.monotonic() - start < timeout, f"still alive after {timeout}s: {[p for p in pids if not _gone(p)]}"
        time.sleep(0.05)
    return time.monotonic() - start


def _kill_launcher_while_training(tmp_path: Path, command: list[str]) -> float:
    """Start `command` (a launcher of 2 ranks running a long `shardtrain train`), wait until the ranks
    train, SIGKILL the launcher alone; return the seconds until both ranks are gone."""
    args = [
        *TINY,
        "--train.steps",
        "100000",
        "--train.log_every",
        "1",
        "--train.eval_every",
        "0",
        "--train.eval_batches",
        "1",
        *_on_one_file(tmp_path),
        "--run.name",
        "run",
    ]
    launcher = subprocess.Popen(
        [*command, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    ranks: list[int] = []
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and '"train"' in metrics.read_text()):
            assert launcher.poll() is None, f"the launcher exited with {launcher.returncode}"
            assert time.monotonic() < deadline, "the ranks never started training"
            time.sleep(0.2)
        ranks = [c.pid for c in psutil.Process(launcher.pid).children() if "shardtrain" in " ".join(c.cmdline())]
        assert len(ranks) == 2, ranks
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        return _wait_gone(ranks, timeout=30)
    finally:
        for pid in ranks:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.slow  # end to end in fresh processes; test_the_polling_watch_alone_ends_an_orphan covers the watch
def test_killing_shardtrain_train_kills_its_ranks(tmp_path):
    took = _kill_launcher_while_training(tmp_path, [sys.executable, "-m", "shardtrain", "train"])
    assert took < EXIT_WITHIN_S, f"the ranks outlived their launcher by {took:.2f}s"


@pytest.mark.slow
def test_killing_torchruns_agent_kills_its_ranks(tmp_path):
    took = _kill_launcher_while_training(
        tmp_path,
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "shardtrain",
            "train",
        ],
    )
    assert took < EXIT_WITHIN_S, f"the ranks outlived torchrun's agent by {took:.2f}s"


# The grandchild loads engine/lifeline.py (standard library only) by its path: importing it as
# shardtrain.engine.lifeline would import the Engine, torch with it (~5 s), which the watch does not use.
GRANDCHILD = (
    "import importlib.util, os, threading; "
    f"spec = importlib.util.spec_from_file_location('lifeline', {str(Path(lifeline.__file__))!r}); "
    "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
    "t = threading.Thread(target=module.watch, args=(os.getppid(),), kwargs={'interval': 0.05}); t.start(); "
    "print('watching', flush=True); t.join()"
)
MIDDLE = (
    "import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
    "print(child.pid, flush=True); child.wait()"
)


def test_the_polling_watch_alone_ends_an_orphan():
    """Where prctl is unavailable the watch thread is what remains: on its own it ends the process."""
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE, GRANDCHILD], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = int(middle.stdout.readline())
    try:
        assert middle.stdout.readline().strip() == "watching" and not _gone(child)
        os.kill(middle.pid, signal.SIGKILL)
        middle.wait()
        assert _wait_gone([child], timeout=10) < 1.0
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
