"""offload/step_queue.py: the host step's worker runs, of the queued steps, the most urgent first."""

import threading

import pytest
import torch

from shardtrain.offload.step_queue import StepQueue, worker_threads


def test_runs_the_lowest_priority_first_then_by_arrival():
    """While the worker is busy, steps arrive in backward order (last unit first); it then runs them in
    the next forward's order, and a step's error reaches its future only."""
    queue = StepQueue(device=torch.device("cpu"))
    release, ran = threading.Event(), []
    first = queue.submit(0, release.wait)
    futures = [queue.submit(p, lambda p=p: ran.append(p)) for p in (5, 3, 4, 1, 3)]
    failing = queue.submit(2, lambda: 1 / 0)
    release.set()
    first.result(timeout=10)
    for future in futures:
        future.result(timeout=10)
    assert ran == [1, 3, 3, 4, 5]
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)


def test_worker_threads():
    threads = torch.get_num_threads()
    try:  # the default leaves the main thread one core
        torch.set_num_threads(4)
        assert worker_threads() == 3
        torch.set_num_threads(1)
        assert worker_threads() == 1
        torch.set_num_threads(3)  # the worker takes its count when it starts
        seen = []
        StepQueue(device=torch.device("cpu")).submit(0, lambda: seen.append(torch.get_num_threads())).result(timeout=10)
    finally:
        torch.set_num_threads(threads)
    assert seen == [2]
