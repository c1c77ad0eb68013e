"""hybrid_shard across two "nodes": two torchrun invocations of 2 processes each, on loopback."""

import os
import socket
import subprocess
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hybrid_shard_over_two_torchrun_nodes():
    script = os.path.join(os.path.dirname(__file__), "two_nodes.py")
    port = _free_port()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
                               f"--node_rank={rank}", "--master_addr=127.0.0.1", f"--master_port={port}", script],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = []
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for n in nodes:
                n.kill()
            raise
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out[-3000:]
    assert sum(out.count("2 hybrid cases passed") for out in outputs) == 4, outputs
