"""hybrid_shard across two "nodes": two torchrun invocations of 2 processes each, on loopback."""

import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

DEADLINE_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_hybrid_shard_over_two_torchrun_nodes():
    script = os.path.join(os.path.dirname(__file__), "two_nodes.py")
    port = _free_port()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as logs:
        paths = [os.path.join(logs, f"node{rank}.log") for rank in (0, 1)]
        nodes = []
        for rank, path in enumerate(paths):
            with open(path, "w") as log:
                nodes.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "torch.distributed.run",
                            "--nnodes=2",
                            "--nproc_per_node=2",
                            f"--node_rank={rank}",
                            "--master_addr=127.0.0.1",
                            f"--master_port={port}",
                            script,
                        ],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
        # Note: watch both nodes at once: when one fails, the other's torchrun waits at its exit barrier,
        # so waiting on the nodes in turn would time out on the healthy one and hide the failure.
        deadline = time.monotonic() + DEADLINE_S
        while any(n.poll() is None for n in nodes) and time.monotonic() < deadline:
            if any(n.poll() not in (None, 0) for n in nodes):
                break
            time.sleep(0.2)
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.wait()
        outputs = [open(path).read() for path in paths]
    report = "\n".join(
        f"--- node {rank} (exit {n.returncode}):\n{out[-3000:]}" for rank, (n, out) in enumerate(zip(nodes, outputs))
    )
    assert all(n.returncode == 0 for n in nodes), report
    assert sum(out.count("2 hybrid cases passed") for out in outputs) == 4, report
