"""A save killed (SIGKILL) half way leaves the previous checkpoint and its `latest` pointer intact;
it loads and trains on, and the next save commits and removes the abandoned staging directory."""

import os
import signal
import socket
import time

import torch
import torch.multiprocessing as mp

from tests.checkpoint.train_save_ranks import crash_during_save, resume_after_crash


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kill_during_save_keeps_the_last_checkpoint(pools, tmp_path):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=crash_during_save, args=(r, 2, port, str(tmp_path)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    try:
        while not all((tmp_path / f"paused-{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, "the save never reached the pause"
            assert all(p.is_alive() for p in procs), f"a writer died early: {[p.exitcode for p in procs]}"
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=30)
    assert [p.exitcode for p in procs] == [-signal.SIGKILL] * 2

    run = tmp_path / "run"
    assert (run / "latest").read_text().strip() == "step2"
    assert not (run / "step3").exists()
    staging = [d for d in run.iterdir() if ".tmp-" in d.name]
    assert len(staging) == 1 and any(staging[0].iterdir()), "the killed save should have left its partial files"

    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    pools(2).run(resume_after_crash, str(run), expected)
    assert sorted(d.name for d in run.iterdir()) == ["latest", "step2", "step3"]
    assert (run / "latest").read_text().strip() == "step3"
