"""Which processes run on which devices, and joining the process group.

`devices="auto"` means every visible GPU with NCCL, else two CPU processes with Gloo (two ranks are
the smallest world in which sharding does anything, and they fit on any laptop). Under an external
launcher (torchrun, Slurm with the torch env variables) the launcher decides the world; `devices` is
then only checked against it.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

CPU_AUTO_PROCESSES = 2
_ACCELERATORS = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The local processes to run: on which kind of device, how many, talking through which backend."""

    accelerator: str  # "cuda" | "cpu"
    num_processes: int

    @property
    def backend(self) -> str:
        return "nccl" if self.accelerator == "cuda" else "gloo"


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """Where this process sits in the world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def resolve_topology(*, accelerator: str, devices: int | str) -> Topology:
    """Turn the user's `accelerator` and `devices` into a concrete `Topology`."""
    if accelerator not in _ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r} is not known; use one of {list(_ACCELERATORS)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if accelerator == "cuda" and gpus == 0:
        raise ValueError("accelerator='cuda' but no CUDA device is visible; use accelerator='cpu' or 'auto'")
    kind = "cuda" if accelerator == "cuda" or (accelerator == "auto" and gpus > 0) else "cpu"
    if devices == "auto":
        return Topology(accelerator=kind, num_processes=gpus if kind == "cuda" else CPU_AUTO_PROCESSES)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r} is not understood; use 'auto' or a positive number of processes")
    if kind == "cuda" and devices > gpus:
        raise ValueError(f"devices={devices} but only {gpus} CUDA device(s) are visible; use devices<={gpus} or 'auto'")
    return Topology(accelerator=kind, num_processes=devices)


def launched_externally() -> bool:
    """Whether a launcher (torchrun, our own spawner, Slurm via torch env vars) already placed this rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_info_from_env() -> RankInfo:
    world_size = int(os.environ["WORLD_SIZE"])
    return RankInfo(
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
    )


def device_for(topology: Topology, local_rank: int) -> torch.device:
    if topology.accelerator == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def configure_threads(topology: Topology, local_world_size: int) -> None:
    """Split the CPU cores between the local ranks (torch would otherwise give every rank all cores).

    An explicit OMP_NUM_THREADS (torchrun sets 1) is respected.
    """
    if topology.accelerator != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // local_world_size))


def join_process_group(topology: Topology, info: RankInfo, *, timeout: timedelta | None) -> torch.device:
    """Join (or create) the default process group for this rank and return its device.

    A group that already exists (the caller initialised it) is reused as is. A world of one needs no
    rendezvous: it runs on an in-memory store.
    """
    if topology.accelerator == "cuda" and info.local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"local rank {info.local_rank} has no GPU: only {torch.cuda.device_count()} are visible; "
            f"launch at most {torch.cuda.device_count()} processes per node"
        )
    device = device_for(topology, info.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    configure_threads(topology, info.local_world_size)
    if dist.is_initialized():
        return device
    kwargs: dict[str, Any] = {"timeout": timeout, "device_id": device if device.type == "cuda" else None}
    if info.world_size == 1 and not launched_externally():
        dist.init_process_group(topology.backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    else:
        dist.init_process_group(topology.backend, rank=info.rank, world_size=info.world_size, **kwargs)
    atexit.register(_destroy_process_group)
    _watch_uncaught_exceptions()
    return device


_EXIT_BARRIER_TIMEOUT = timedelta(seconds=30)
_failures: list[BaseException | str] = []  # this rank failed: no exit barrier then


def mark_failed(reason: BaseException | str) -> None:
    """Record that this rank is exiting because of a failure, so it does not wait for its peers at exit."""
    _failures.append(reason)


def _watch_uncaught_exceptions() -> None:
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        mark_failed(value)
        previous(kind, value, traceback)

    sys.excepthook = hook


def _destroy_process_group() -> None:
    """At exit: a Gloo rank first waits for its peers, then every rank tears the groups down.

    Note: a Gloo rank whose peer closes its connections before this rank starts its own teardown can
    abort at exit ("terminate called without an active exception"); the barrier makes the ranks tear
    down together. It is skipped when this rank failed (an uncaught exception, a failing spawned
    function, or `mark_failed`: the launcher stops the others), and bounded by a timeout; when it
    times out the groups are left to the interpreter, since a peer may be stuck in a collective.
    """
    if not dist.is_initialized():
        return
    if not _failures and dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=_EXIT_BARRIER_TIMEOUT)
        except RuntimeError:
            return
    dist.destroy_process_group()
