"""What this machine offers a plan: the memory each local process may use, and how many share the host."""

from __future__ import annotations

import os

import torch


def local_device_memory(*, accelerator: str, processes: int) -> tuple[int, str]:
    """Memory each of `processes` local processes may use, and where the number comes from.

    CUDA: the first visible GPU's total memory. CPU: the host's physical memory split evenly between
    the processes. Raises ValueError when the accelerator is CUDA and none is visible here.
    """
    if accelerator == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "the run targets CUDA devices but none is visible here; give the device memory "
                "explicitly (e.g. device_memory='141GB', or --device-memory 141GB)"
            )
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"the local {props.name}"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // processes, f"host memory / {processes} processes"


def plan_memory(
    *,
    device_memory: int | str | None,
    host_memory: int | str | None,
    disk_dir: str | None,
    world_size: int,
    accelerator: str,
    processes: int,
) -> tuple[int | str, int | str | None]:
    """(device, host) memory the automatic plan weighs: the given ones, else this machine's.

    Device memory: each of `processes` local processes' share of `accelerator`. Host memory (this host's
    share per process) bounds offload only when the plan is for this machine's devices (no
    `device_memory` given) or `disk_dir` offers the disk tier; otherwise it stays unchecked (None).
    """
    if host_memory is None and (device_memory is None or disk_dir is not None):
        host_memory, _ = local_device_memory(accelerator="cpu", processes=local_processes(world_size))
    if device_memory is None:
        device_memory, _ = local_device_memory(accelerator=accelerator, processes=processes)
    return device_memory, host_memory


def local_processes(world_size: int) -> int:
    """The processes sharing this machine's host memory: the launcher's LOCAL_WORLD_SIZE, else the world."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
