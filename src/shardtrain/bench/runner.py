"""Run every (size, engine) in fresh processes under torchrun, interleaved and repeated; collect rows.

For each size, each repeat runs every engine once, the order rotated by one per repeat so no engine
always runs first (a cold machine) or last (a warm one). Each run is a new
`python -m torch.distributed.run ... -m shardtrain.bench.worker` process group: no engine inherits
another's allocator state, compiled kernels or NCCL communicators. The ideal step, if asked, runs
once per size in one process, before the engines. With a deadline, runs not started in time are
reported as skipped, so a time-boxed bench still ends with a complete table.

NVLink multicast stays off in every child (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1): on the shared GPU hosts a program that uses it can take the GPUs down.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .registry import IDEAL, resolve_engine
from .results import OK, Row, RunRecord, aggregate
from .sizes import parse_size
from .spec import RunSpec
from .worker import OUT_OF_MEMORY, failure_path

CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LOG_TAIL_LINES = 20
SKIPPED = "skipped"


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """What `shardtrain bench` was asked to run, with the machine-dependent defaults resolved."""

    sizes: tuple[str, ...]
    engines: tuple[str, ...]
    batch: int
    seq: int | None  # None: each size's own max_seq_len
    ac: bool
    steps: int
    warmup: int
    repeats: int
    nproc: int
    device: str
    precision: str
    peak_tflops: float | None
    json_path: str | None = None
    profile_steps: int = 0
    trace_dir: str | None = None
    ideal: bool = False
    timeout_s: float = 900.0
    deadline_s: float | None = None  # launch no run after this many seconds (the rest: "skipped")
    seed: int = 0
    compile: bool = False
    float8: bool = False

    def __post_init__(self) -> None:
        for engine in self.engines:
            if resolve_engine(engine).single_process:
                raise ValueError(f"{engine!r} is not an engine to compare; ask for it with --ideal")
        for size in self.sizes:
            parse_size(size)
        if self.repeats < 1 or self.nproc < 1:
            raise ValueError(f"repeats={self.repeats} and nproc={self.nproc} must be at least 1")

    def spec(self, *, size: str, engine: str) -> RunSpec:
        """The run of `engine` on `size` (a size token, sizes.py: its own batch and checkpointing win)."""
        parsed = parse_size(size)
        return RunSpec(
            engine=engine,
            size=size,
            batch=parsed.batch or self.batch,
            seq=self.seq or parsed.model_config().max_seq_len,
            ac=parsed.ac or self.ac,
            steps=self.steps,
            warmup=self.warmup,
            device=self.device,
            precision=self.precision,
            seed=self.seed,
            compile=self.compile,
            float8=self.float8,
            shard_world=self.nproc,
        )


def planned_runs(options: BenchOptions) -> list[tuple[RunSpec, int, int]]:
    """(spec, nproc, repeat) in the order they run."""
    plan = []
    for size in options.sizes:
        if options.ideal:  # first: a reference that a time budget should not cut
            plan.append((_profiled(options, options.spec(size=size, engine=IDEAL)), 1, 0))
        for repeat in range(options.repeats):
            shift = repeat % len(options.engines)
            for engine in options.engines[shift:] + options.engines[:shift]:
                spec = options.spec(size=size, engine=engine)
                plan.append((_profiled(options, spec) if repeat == 0 else spec, options.nproc, repeat))
    return plan


def _profiled(options: BenchOptions, spec: RunSpec) -> RunSpec:
    """`spec` with the profiler on when --profile asks for it (the ideal step too: its compute time is
    what the engines' compute time compares with)."""
    if not options.profile_steps:
        return spec
    name = f"trace_{spec.size}_{spec.engine}.json.gz"
    return replace(
        spec,
        profile_steps=options.profile_steps,
        trace_path=os.path.join(options.trace_dir, name) if options.trace_dir else "",
    )


def child_environment(*, device: str, nproc: int) -> dict[str, str]:
    """The parent's environment, multicast off, shardtrain importable, the CPU cores split between
    `nproc` ranks (the ideal step passes the engines' rank count: it stands for one of their ranks)."""
    env = dict(os.environ)
    env.update(CHILD_ENV)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // nproc))
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: RunSpec, *, nproc: int, repeat: int, workdir: str, timeout_s: float) -> RunRecord:
    """One torchrun process group running the worker for `spec`; its result or the reason it has none."""
    tag = f"{spec.size}_{spec.engine}_r{repeat}"
    out, log_path = os.path.join(workdir, f"{tag}.json"), os.path.join(workdir, f"{tag}.log")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "shardtrain.bench.worker",
        "--json-out",
        out,
        *spec.to_argv(),
    ]
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            env=child_environment(device=spec.device, nproc=spec.shard_world),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc = None
    return read_outcome(
        RunRecord(spec=spec, nproc=nproc, repeat=repeat, status=OK, wall_s=time.monotonic() - start),
        out=out,
        rc=rc,
        log_path=log_path,
        timeout_s=timeout_s,
    )


def read_outcome(record: RunRecord, *, out: str, rc: int | None, log_path: str, timeout_s: float) -> RunRecord:
    """Fill `record` from what the workers left: rank 0's result, else a rank's failure (out of
    memory first), else a timeout, else the exit code and the end of the log (out of memory if
    the log says so)."""
    if os.path.exists(out):
        with open(out) as f:
            return replace(record, status=OK, result=json.load(f))
    failures = []
    for rank in range(record.nproc):
        path = failure_path(out, rank)
        if os.path.exists(path):
            with open(path) as f:
                failures.append(json.load(f))
    if failures:
        chosen = next((f for f in failures if f["status"] == OUT_OF_MEMORY), failures[0])
        return replace(record, status=chosen["status"], error=chosen["error"])
    if rc is None:
        return replace(record, status="timed out", error=f"no result after {timeout_s:.0f} s")
    tail = _tail(log_path)
    # A rank can die of an out-of-memory error outside Python (NCCL's watchdog aborts the process).
    status = OUT_OF_MEMORY if "out of memory" in tail.lower() else "failed"
    return replace(record, status=status, error=f"exit code {rc}; log tail:\n{tail}")


def _stop(proc: subprocess.Popen) -> None:
    """End the torchrun we started and its workers (its own process group), politely then firmly."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: str) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-LOG_TAIL_LINES:])


def run_bench(options: BenchOptions, *, log: Callable[[str], None] = print) -> list[Row]:
    """Run the whole plan; after each run print a progress line and rewrite `options.json_path`."""
    if options.trace_dir:
        os.makedirs(options.trace_dir, exist_ok=True)
    plan = planned_runs(options)
    records: list[RunRecord] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shardtrain-bench-") as workdir:
        for i, (spec, nproc, repeat) in enumerate(plan, 1):
            if options.deadline_s is not None and time.monotonic() - start > options.deadline_s:
                record = RunRecord(
                    spec=spec,
                    nproc=nproc,
                    repeat=repeat,
                    status=SKIPPED,
                    wall_s=0.0,
                    error=f"not started: the --deadline of {options.deadline_s:.0f} s had passed",
                )
            else:
                record = launch(spec, nproc=nproc, repeat=repeat, workdir=workdir, timeout_s=options.timeout_s)
            records.append(record)
            log(f"[{i}/{len(plan)}] {_progress(record)}")
            if options.json_path:
                write_json(options.json_path, options=options, records=records)
    return aggregate(records, peak_tflops=options.peak_tflops)


def _progress(record: RunRecord) -> str:
    spec = record.spec
    head = f"{spec.size} {spec.engine} (repeat {record.repeat + 1}, {record.nproc} proc): "
    if record.status != OK:
        return head + f"{record.status} after {record.wall_s:.0f} s" + (f"\n{record.error}" if record.error else "")
    res = record.result
    ms = sorted(res["step_ms"])[len(res["step_ms"]) // 2]
    mem = res["memory_gib"]
    memory = f"{mem['allocated']:.1f} GiB allocated" if mem["allocated"] is not None else f"{mem['rss']:.2f} GiB RSS"
    return head + (
        f"{spec.tokens_per_rank_step * 1000 / ms:,.0f} tok/s/rank, step {ms:.1f} ms, {memory}, "
        f"loss@{len(res['losses'])} {res['losses'][-1]:.4f} ({record.wall_s:.0f} s)"
    )


def write_json(path: str, *, options: BenchOptions, records: list[RunRecord]) -> None:
    """Rows, raw runs and the conditions, written atomically (a partial bench still leaves valid JSON)."""
    rows = aggregate(records, peak_tflops=options.peak_tflops)
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "argv": sys.argv,
        "options": {k: getattr(options, k) for k in options.__dataclass_fields__},
        "device_name": next((r.result["device_name"] for r in records if r.result), None),
    }
    payload = {"meta": meta, "rows": [r.to_dict() for r in rows], "runs": [r.to_dict() for r in records]}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)
