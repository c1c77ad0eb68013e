import pytest
import torch

from shardtrain.testing import ProcessGroupPool


@pytest.fixture(scope="session")
def pools():
    """`pools(n)` returns a persistent Gloo pool of n ranks, started on first use."""
    started: dict[int, ProcessGroupPool] = {}

    def get(world_size: int) -> ProcessGroupPool:
        if world_size not in started:
            started[world_size] = ProcessGroupPool(world_size)
        return started[world_size]

    yield get
    for pool in started.values():
        pool.close()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
