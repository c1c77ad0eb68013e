"""The training loop's CUDA-only branches, which the CPU tiers never take: pinned batches copied without
blocking, the main job end to end, CPU offload and its disk tier on a small model, and the 2-D (dp, tp)
path at tp 1 against the 1-D one."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shardtrain.data.batches import WindowBatches
from shardtrain.train.data import TokenBatches
from shardtrain.train.step import Job
from tests.gpu.scripts import records, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ORDER = dict(global_batch=4, rank=0, world_size=1, seed=0)
SMALL = ["--model.name", "llama-2m", "--data.seq_len", "128", "--train.batch_size", "8", "--train.eval_every", "20"]


def test_every_source_is_pinned_and_copied_without_blocking():
    tokens = np.arange(5000, dtype=np.uint16) % 251
    windows = {
        "input_ids": [list(range(1, 9)), list(range(1, 17))] * 2,
        "labels": [[-100] * 4 + list(range(4)), list(range(16))] * 2,
        "position_ids": [list(range(8)), list(range(16))] * 2,
    }
    sources = [
        TokenBatches(tokens, seq_len=64, shuffle=True, **ORDER),
        TokenBatches(tokens, seq_len=64, shuffle=False, **ORDER),
        WindowBatches(_Rows(windows), seq_len=16, pad_id=0, shuffle=True, **ORDER),
    ]
    job = SimpleNamespace(engine=SimpleNamespace(device=torch.device("cuda")))
    for source in sources:
        batch = source.batch(0)
        on_device = Job.to_device(job, batch)
        torch.cuda.synchronize()
        for name, t in batch.items():
            assert on_device[name].is_cuda and torch.equal(on_device[name].cpu(), t), name


class _Rows:
    """What WindowBatches indexes: a list of row numbers -> the columns of those rows."""

    def __init__(self, columns: dict[str, list]):
        self.columns = columns

    def __len__(self) -> int:
        return len(self.columns["input_ids"])

    def __getitem__(self, rows: list[int]) -> dict[str, list]:
        return {k: [v[r] for r in rows] for k, v in self.columns.items()}


def test_main_job_trains_on_cuda(tmp_path):
    out = train("--train.steps", "40", "--run.checkpoint_every", "20", out_dir=tmp_path, name="main")
    evals = records(tmp_path / "main", "eval")
    assert "1 x cuda" in out and evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 1.0, evals
    # --resume from step 20 replays steps 21-40 (same device, same kernels: the same losses to bf16 noise)
    train(
        "--train.steps",
        "40",
        "--resume",
        str(tmp_path / "main" / "checkpoints" / "step_000020"),
        out_dir=tmp_path,
        name="resumed",
    )
    first = {r["step"]: r["loss"] for r in records(tmp_path / "main", "train")}
    again = {r["step"]: r["loss"] for r in records(tmp_path / "resumed", "train")}
    assert sorted(again) == [s for s in sorted(first) if s > 20]
    for step, loss in again.items():
        assert loss == pytest.approx(first[step], rel=2e-2), (step, loss, first[step])


def test_offloaded_runs_train_like_the_device_run(tmp_path):
    steps = [*SMALL, "--train.steps", "20", "--optim.warmup_steps", "2"]
    train(*steps, out_dir=tmp_path, name="device")
    device = [r["loss"] for r in records(tmp_path / "device", "train")]
    assert len(device) == 2 and device[-1] < device[0]
    offloads = {
        "every unit": ["--engine.cpu_offload", "true"],
        "half": ["--engine.cpu_offload", "0.5"],
        "disk tier": ["--engine.cpu_offload", "true", "--engine.offload_dir", str(tmp_path / "disk")],
    }
    (tmp_path / "disk").mkdir()
    for name, offload in offloads.items():
        train(*steps, *offload, out_dir=tmp_path, name=name)
        offloaded = [r["loss"] for r in records(tmp_path / name, "train")]
        # The host step runs AdamW in fp32 on the CPU, the device step fused on the GPU: the same update
        # to rounding, so the runs' losses agree closely over 20 steps.
        assert offloaded == pytest.approx(device, rel=2e-2), (name, offloaded, device)


def test_two_dimensional_path_at_tp_1_trains_like_the_one_dimensional(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    import shardtrain as st
    from shardtrain.models.llama import Block, Llama, llama_config

    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        losses = []
        for two_d in (False, True):
            torch.manual_seed(0)  # the same weights in both (a meta build draws them differently per path)
            model = Llama(llama_config("tiny", n_layers=2))
            extra = {}
            if two_d:
                extra = dict(
                    mesh=init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp", "tp")), tp_plan=st.tp.llama_plan()
                )
            st.shard(model, wrap={Block}, **extra)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            gen = torch.Generator().manual_seed(1)
            run = []
            for _ in range(5):
                tokens = torch.randint(0, 256, (2, 65), generator=gen).cuda()
                loss = model.loss(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                st.clip_grad_norm_(model, 1.0)
                opt.step()
                opt.zero_grad()
                run.append(loss.item())
            losses.append(run)
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
        assert losses[0][-1] < losses[0][0]
    finally:
        dist.destroy_process_group()
