"""Rank-side code of the disk tier tests (offload/disk_state.py): optimizer state in per-rank files,
streamed through the deferred per-unit host step, against the same step with the state in host memory.

On a CPU device nothing is offloaded, so the runs hand every unit to `overlap_host_steps` (as
tests/offload/host_step_ranks.py does) and attach the disk tier to it as `st.shard` does for offloaded
units.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import shardtrain as st
from shardtrain.core.shard_module import runtime_of
from shardtrain.core.sharded_param import local_of
from shardtrain.models.llama import Block
from shardtrain.offload import aio, disk_file
from shardtrain.offload.attach import attach_disk_state
from shardtrain.offload.disk_layout import on_disk
from shardtrain.offload.disk_state import DiskState
from shardtrain.offload.host_step import overlap_host_steps
from tests.core.parity import _chunk
from tests.models import lm_loss, make_batches, tiny_llama
from tests.offload.host_step_ranks import (
    CHECKPOINT_STEP,
    MICRO,
    PER,
    Run,
    device,
    final_state,
    make_optimizer,
    train_step,
)

STEPS = 10


def build(directory: str | None, *, buffer_bytes: int | None = None, direct: bool = True, fraction: float = 1.0) -> Run:
    """The tiny Llama with its AdamW state in files under `directory` (None: in host memory). On CUDA
    `st.shard` offloads `fraction` of the parameters (whole units) and attaches the disk tier; on the
    CPU every unit is host-stepped and the tier attached here. `direct=False` makes the probe report no
    O_DIRECT (as tmpfs before Linux 6.6 does)."""
    torch.manual_seed(0)
    model = tiny_llama().to(device())
    cuda = device().type == "cuda"
    policy = None
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
        policy = st.CPUOffload(fraction=fraction, disk_dir=directory, disk_buffer_bytes=buffer_bytes)
    real_probe = disk_file.direct_supported
    disk_file.direct_supported = real_probe if direct else lambda d: False
    try:
        st.shard(
            model,
            strategy="full_shard",
            wrap={Block},
            cpu_offload=(policy or st.CPUOffload(fraction=fraction)) if cuda else False,
        )
        runtime = runtime_of(model)
        steps = runtime.step_hook if cuda else overlap_host_steps(model, runtime, runtime.units)
        if policy is not None and not cuda:
            attach_disk_state(steps, policy, rank=dist.get_rank())
    finally:
        disk_file.direct_supported = real_probe
    if policy is not None:
        assert steps.store.direct == direct, f"{directory}: O_DIRECT {steps.store.direct}, expected {direct}"
    optimizer = make_optimizer(model, "adamw_fused")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.8**s)
    return Run(
        model=model, optimizer=optimizer, scheduler=scheduler, steps=steps, stepped=[0], in_backward=False, clip=True
    )


def batches(steps: int) -> list:
    data = make_batches("llama", steps=steps, global_batch=dist.get_world_size() * MICRO * PER)
    return [tuple(t.to(device()) for t in batch) for batch in data]


def store_of(run: Run) -> DiskState:
    assert run.steps is not None and run.steps.store is not None
    return run.steps.store


def expected_file_bytes(run: Run) -> int:
    """Each unit's AdamW moments (two fp32 tensors per parameter, 64-byte aligned), the unit's region
    rounded up to 4096 bytes."""
    total = 0
    assert run.steps is not None
    for unit in run.steps.units:
        end = 0
        for p in unit.params:
            for _ in ("exp_avg", "exp_avg_sq"):
                end = -(-end // 64) * 64 + local_of(p).numel() * 4
        total += aio.align_up(end)
    return total


def region_bytes(unit) -> int:
    """A unit's region, at most: two fp32 moments per parameter's local rows, each on 64 bytes, aligned."""
    return aio.align_up(sum(-(-local_of(p).numel() * 4 // 64) * 64 * 2 for p in unit.params))


def check_on_disk(run: Run) -> int:
    """Every moment of an offloaded unit is in the file (empty storage), the others where their unit
    lives; the file has the expected size. The file's bytes."""
    runtime_of(run.model)  # completes the pending steps
    store = store_of(run)
    store.drain()
    assert run.steps is not None
    offloaded = {id(p) for unit in run.steps.units for p in unit.params}
    for p, state in run.optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            where = on_disk(local_of(state[key]))
            assert where == (id(p) in offloaded), f"{key} of a {tuple(p.shape)} parameter: on disk {where}"
        assert not on_disk(state["step"]), "the step count stays in host memory"
    size = os.path.getsize(store.file.path)
    assert store.file_bytes() == size == expected_file_bytes(run), (store.file_bytes(), size, expected_file_bytes(run))
    return size


def resume(run: Run, directory: str | None, checkpoint: str, **kw) -> Run:
    state = {"model": run.model, "optimizer": run.optimizer, "scheduler": run.scheduler}
    st.save_checkpoint(checkpoint, state)  # reads the state back from the files
    fresh = build(directory, **kw)
    st.load_checkpoint(checkpoint, {"model": fresh.model, "optimizer": fresh.optimizer, "scheduler": fresh.scheduler})
    return fresh


def train(run: Run, data: list, first: int = 0, *, resume_to=None) -> tuple[Run, list[float]]:
    norms = []
    for step, batch in enumerate(data[first:], start=first):
        norms.append(train_step(run, batch, step))
        if resume_to is not None and step == CHECKPOINT_STEP:
            run = resume_to(run)
    return run, norms


def final(run: Run) -> list[tuple[str, torch.Tensor]]:
    run.optimizer.state_dict()  # reads the disk tier's state back into host memory
    return final_state(run)


def same_norms(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def assert_same(got: list, want: list, what: str) -> None:
    assert [n for n, _ in got] == [n for n, _ in want], what
    for (name, a), (_, b) in zip(got, want):
        assert torch.equal(a, b), f"{what}: {name} differs: max |diff| {(a.float() - b.float()).abs().max()}"


def disk_equals_memory(directory: str, disk: str, steps: int = STEPS, *, fraction: float = 1.0) -> dict:
    """10 steps with accumulation, clipping, a skipped step and a checkpoint resume, the state in host
    memory and then on disk, bitwise. `disk`: "direct" (O_DIRECT, the default pool) or "buffered"
    (buffered I/O, a pool of one unit: read, step and write in turn). `fraction`: the share offloaded
    (on CUDA; partial offload puts only the offloaded units' state on disk). The resume comes after
    step CHECKPOINT_STEP when `steps` go past it. The state file's bytes."""
    data = batches(steps)
    state_dir = f"{directory}/state-{dist.get_rank()}"
    memory_kw: dict = {"fraction": fraction}
    disk_kw = dict(memory_kw)
    if disk == "buffered":
        largest = max(region_bytes(u) for u in runtime_of(build(None).model).units)
        disk_kw.update(direct=False, buffer_bytes=largest)
    results = {}
    for name, where in (("memory", None), (disk, state_dir)):
        kw = disk_kw if where else memory_kw
        run = build(where, **kw)
        checkpoint = f"{directory}/ckpt-{name}"
        run, norms = train(run, data, resume_to=lambda r, d=where, c=checkpoint, k=kw: resume(r, d, c, **k))
        if where is not None:
            size = check_on_disk(run)
            assert store_of(run).slot_count() == (1 if disk == "buffered" else 4)
        results[name] = (norms, final(run))
    assert same_norms(results[disk][0], results["memory"][0]), f"{disk}: norms {results[disk][0]}"
    assert_same(results[disk][1], results["memory"][1], disk)
    return size


# ------------------------------------------------------------------------------------ crash and resume
def crash(rank: int, world: int, port: int, directory: str, when: str) -> None:
    """A 2-process job (not the pool): train on the disk tier, checkpoint after step CHECKPOINT_STEP,
    then be killed: rank 1 SIGKILLs itself between two steps, or inside a state write (half written)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    run = build(f"{directory}/state")
    data = batches(STEPS)
    kill_step = CHECKPOINT_STEP + 2
    for step, batch in enumerate(data[: kill_step + 1]):
        if step == kill_step and rank == 1 and when == "write":
            transfer = aio._transfer

            def half_then_die(fd, piece, offset, write):
                if write:
                    transfer(fd, piece[: len(piece) // 2 // aio.ALIGN * aio.ALIGN], offset, write)
                    Path(f"{directory}/killed").touch()
                    os.kill(os.getpid(), signal.SIGKILL)
                transfer(fd, piece, offset, write)

            aio._transfer = half_then_die
        train_step(run, batch, step)
        if step == CHECKPOINT_STEP:
            state = {"model": run.model, "optimizer": run.optimizer, "scheduler": run.scheduler}
            st.save_checkpoint(f"{directory}/ckpt", state)
    runtime_of(run.model)  # the last step's unit steps (and their writes) run
    store_of(run).drain()
    if rank == 1:
        Path(f"{directory}/killed").touch()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # rank 0 waits to be killed by the test


_UNINTERRUPTED: list = []  # [norms, final state] of the run without a kill, in host memory


def resume_after_kill(directory: str) -> int:
    """Resume from the checkpoint on the directory the killed job used; equal the uninterrupted run."""
    data = batches(STEPS)
    if not _UNINTERRUPTED:  # the same run for every kill: computed once per pool process
        reference, norms = train(build(None), data)
        _UNINTERRUPTED.extend([norms, final(reference)])
    want_norms, want = _UNINTERRUPTED
    stale = sorted(Path(f"{directory}/state").glob(f"*-rank{dist.get_rank()}-*.state"))
    run = build(f"{directory}/state")
    assert not [p for p in stale if p.exists()], f"the killed run's files were not removed: {stale}"
    st.load_checkpoint(
        f"{directory}/ckpt", {"model": run.model, "optimizer": run.optimizer, "scheduler": run.scheduler}
    )
    run, norms = train(run, data, first=CHECKPOINT_STEP + 1)
    check_on_disk(run)
    assert same_norms(norms, want_norms[CHECKPOINT_STEP + 1 :]), f"norms after the resume: {norms} vs {want_norms}"
    assert_same(final(run), want, "after the resume")
    return len(stale)


# ------------------------------------------------------------------------------------ memory
class Wide(nn.Module):
    """8 square linear layers: units of equal size, so the pool holds a small share of the state."""

    def __init__(self, width: int, layers: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} missing from /proc/self/status")


def peak_rss(directory: str, width: int, layers: int) -> dict:
    """Train with two units' state in the pool and the rest on disk. The first step creates the state
    unit by unit: the resident set never holds half of it. Over the next steps the peak resident set
    stays within 10% of the resident set before them plus the pool."""
    import ctypes

    # Note: glibc keeps freed heap memory for reuse; a fixed mmap threshold returns every large free to
    # the system, so the resident set follows the live tensors.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    torch.manual_seed(dist.get_rank())
    model = Wide(width, layers)
    st.shard(model, strategy="full_shard", wrap={nn.Linear})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    runtime = runtime_of(model)
    steps = overlap_host_steps(model, runtime, runtime.units)
    pool = 2 * aio.align_up(2 * 4 * width * width // dist.get_world_size())
    store = attach_disk_state(steps, st.CPUOffload(disk_dir=directory, disk_buffer_bytes=pool), rank=dist.get_rank())
    x = torch.randn(4, width)

    def step() -> None:
        model(x).square().mean().backward()
        optimizer.step()
        runtime_of(model)
        optimizer.zero_grad(set_to_none=False)

    model(x).square().mean().backward()  # the gradients exist; no optimizer state yet
    optimizer.zero_grad(set_to_none=False)
    before = _rss_kib("VmRSS") * 1024
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current resident set
    step()
    on_file = store.file_bytes()
    first_peak = _rss_kib("VmHWM") * 1024
    assert first_peak - before < on_file / 2, f"the first step's peak {first_peak} - {before}: state {on_file}"
    resident = _rss_kib("VmRSS") * 1024
    Path("/proc/self/clear_refs").write_text("5")
    for _ in range(3):
        step()
    store.drain()
    peak = _rss_kib("VmHWM") * 1024
    assert store.pool_bytes() == pool and on_file >= 4 * pool, (on_file, pool)
    bound = 1.1 * (resident + pool)
    assert resident + on_file > bound, f"the state ({on_file} bytes) is too small for the check to tell"
    assert peak <= bound, f"peak RSS {peak} exceeds the resident set {resident} + the pool {pool} by over 10%"
    return {
        "before": before,
        "first_peak": first_peak,
        "resident": resident,
        "peak": peak,
        "pool": pool,
        "on_disk": on_file,
    }


# ------------------------------------------------------------------------------------ a full disk
def full_disk(directory: str) -> str:
    """The space check before the first write, then ENOSPC from a write: one line each."""
    import shutil
    from collections import namedtuple

    data = batches(3)
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    disk_file.shutil.disk_usage = lambda d: usage(1 << 30, (1 << 30) - 4096, 4096)
    try:
        os.makedirs(f"{directory}/full-{dist.get_rank()}")
        run = build(f"{directory}/full-{dist.get_rank()}")
        try:
            train_step(run, data[0], 0)  # the first step checks before it creates any state
            raise AssertionError("the space check did not stop the step")
        except disk_file.DiskFullError as e:
            first = str(e)
    finally:
        disk_file.shutil.disk_usage = real
    run = build(f"{directory}/full-{dist.get_rank()}")
    for step in range(2):
        train_step(run, data[step], step)
    transfer = aio._transfer

    def no_space(fd, piece, offset, write):
        if write:
            raise OSError(errno.ENOSPC, "No space left on device")
        transfer(fd, piece, offset, write)

    aio._transfer = no_space
    try:
        try:
            train_step(run, data[2], 2)
            runtime_of(run.model)
            store_of(run).drain()
            raise AssertionError("ENOSPC from a write was not reported")
        except disk_file.DiskFullError as e:
            second = str(e)
    finally:
        aio._transfer = transfer
    assert "needs" in first and "needs" in second, (first, second)
    return first


# ------------------------------------------------------------------------------------ the user's own step
def closure_step_equals_memory(directory: str) -> int:
    """A step with a closure is the user's own `step()` (in sequence, one warning): the disk tier reads
    the state back for it and writes it again at the next deferred step; bitwise host memory."""
    import warnings

    data = batches(4)
    results = {}
    for where in (None, f"{directory}/closure-{dist.get_rank()}"):
        run = build(where)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the closure's fallback warning
            for step, batch in enumerate(data):
                loss = lm_loss(run.model, _chunk(batch, dist.get_rank(), MICRO, 0, PER))
                loss.backward()
                if step == 2:
                    run.optimizer.step(lambda: loss)
                else:
                    run.optimizer.step()
                run.optimizer.zero_grad()
        if where is not None:
            check_on_disk(run)
        results[where is None] = final(run)
    assert_same(results[False], results[True], "a closure step on the disk tier")
    return len(results[True])


# ------------------------------------------------------------------------------------ read-ahead
class Funnel(nn.Module):
    """8 narrow layers, then a wide one: units whose state differs 16-fold in size."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))
        self.wide = nn.Linear(64, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.narrow:
            x = torch.tanh(layer(x))
        return self.wide(x)


def _funnel(directory: str | None) -> tuple[nn.Module, torch.optim.Optimizer, DiskState | None]:
    torch.manual_seed(0)
    model = Funnel()
    st.shard(model, strategy="full_shard", wrap={nn.Linear})
    runtime = runtime_of(model)
    steps = overlap_host_steps(model, runtime, runtime.units)
    store = None
    if directory is not None:  # a pool of the wide unit's region: room for all 8 narrow ones at once
        os.makedirs(directory, exist_ok=True)
        pool = max(region_bytes(u) for u in runtime.units)
        store = attach_disk_state(
            steps, st.CPUOffload(disk_dir=directory, disk_buffer_bytes=pool), rank=dist.get_rank()
        )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), store


def read_ahead_depth(directory: str) -> list[tuple[int, int]]:
    """Each step issues the reads of as many units, in step order, as fit in the pool at once (not as
    many as it holds of the largest), and trains bitwise as the state in host memory. Per step after
    the first: (reads issued before the first unit steps, units whose regions fit the pool together)."""
    runs = {where: _funnel(where) for where in (None, f"{directory}/state-{dist.get_rank()}")}
    store = next(s for _, _, s in runs.values() if s is not None)
    depths = []
    begin = store.begin

    def counting_begin(optimizer, tasks) -> None:
        begin(optimizer, tasks)  # the step's tasks are not submitted yet: nothing is fetched
        sizes = [store._regions[u.index].nbytes for u, _ in tasks if u.index in store._regions]
        fit = next((k for k in range(len(sizes), -1, -1) if sum(sizes[:k]) <= store.pool_bytes()), 0)
        depths.append((len(store._reads), fit if sizes else 0))

    store.begin = counting_begin
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(dist.get_rank()))
    for model, optimizer, _ in runs.values():
        for _ in range(3):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        runtime_of(model)
    (memory, _, _), (disk, _, _) = runs.values()
    for (name, want), got in zip(memory.state_dict().items(), disk.state_dict().values()):
        assert torch.equal(local_of(want), local_of(got)), f"{name} differs with the state on disk"
    return depths[1:]
