"""Predicted step time of a CPU-offloaded configuration, with the host optimizer step in sequence,
overlapped with the next forward, or during backward (docs/design.md, Note [Overlapped host step]).

The automatic plan prices every offloaded candidate with it (`speed.step_time`): the GPU, the host
AdamW and PCIe each way, and the disk tier's reads and writes, combined as docs/design.md, Note
[Offload time model] derives. The constants and the predictions against measured steps: BENCHMARKS.md,
'Offload time model: its constants and its predictions (1 × H200)'.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ...options import host_step_overlapped
from ...policy import CPUOffload

PCIE_BYTES_PER_S = 54.5e9  # BENCHMARKS.md, 'Offload time model' (so are the constants below)
HOST_ADAMW_S_PER_PARAM = 0.185e-9  # alone, over plain tensors
DTENSOR_FACTOR = 329 / 283  # the same fused AdamW over DTensors: their dispatch
BESIDE_FORWARD = 381 / 283  # the host step beside the next forward's copies and compute
BESIDE_BACKWARD = 0.33 / 0.185  # ... beside the backward's copies both ways and the next forward
DISK_READ_BYTES_PER_S = 1.77e9
DISK_WRITE_BYTES_PER_S = 2.54e9


class HostStep(enum.Enum):
    """When the host AdamW over the offloaded units runs (offload/host_step.py)."""

    SEQUENTIAL = "in sequence"  # in the user's step(), after backward (SHARDTRAIN_HOST_STEP=sequential)
    OVERLAPPED = "overlapped"  # deferred to the next forward, unit by unit (the default)
    IN_BACKWARD = "in backward"  # CPUOffload(step_in_backward=True)


def host_step_of(offload: CPUOffload) -> HostStep:
    """The host step mode `st.shard` gives `offload` in this process's environment."""
    if not host_step_overlapped():
        return HostStep.SEQUENTIAL
    return HostStep.IN_BACKWARD if offload.step_in_backward else HostStep.OVERLAPPED


@dataclass(frozen=True, kw_only=True)
class OffloadWork:
    """What CPU offload moves per rank, as `offload_step_time` prices it."""

    params: int  # parameters of one rank whose shards live on the host
    units: int  # the offloaded units they are in
    host_step: HostStep = HostStep.OVERLAPPED
    disk_state_bytes: int = 0  # the disk tier's optimizer state of one rank (0: none)
    reshard_after_forward: bool = True  # copied to the device again for backward (CPUOffload.reshards_after_forward)


def disk_seconds(
    state_bytes: int,
    *,
    read_bytes_per_s: float = DISK_READ_BYTES_PER_S,
    write_bytes_per_s: float = DISK_WRITE_BYTES_PER_S,
) -> float:
    """The disk tier's time per step: its state read once and written once, one device serving both."""
    return state_bytes / read_bytes_per_s + state_bytes / write_bytes_per_s


def disk_time(seconds: float) -> str:
    """The disk tier's time per step for a person, with the bandwidths it assumes."""
    return (
        f"reading and writing its state takes {seconds:.1f} s per step at {DISK_READ_BYTES_PER_S / 1e9:.2f} / "
        f"{DISK_WRITE_BYTES_PER_S / 1e9:.2f} GB/s (planning/cost/offload_time.py), the step at least as long"
    )


@dataclass(frozen=True, kw_only=True)
class OffloadTime:
    """The predicted phases of one step, in seconds."""

    forward_s: float  # GPU forward
    backward_s: float  # GPU backward (with the recomputation when checkpointed)
    host_step_s: float  # host AdamW over the offloaded parameters' local rows beside the next forward
    in_backward_host_step_s: float  # the same stepped during backward, beside the copies both ways
    sequential_host_step_s: float  # the same over the DTensors, alone inside the user's step()
    h2d_forward_s: float  # copies of the offloaded shards for the forward
    h2d_backward_s: float  # their copies again for the backward (units resharded after forward)
    d2h_s: float  # the offloaded gradients back to the host
    disk_s: float  # the disk tier: its state read and written once (0 without it)
    sequential_s: float
    overlapped_s: float
    in_backward_s: float  # units stepped during backward where their gradients are final

    @property
    def speedup(self) -> float:
        return self.sequential_s / self.overlapped_s

    def step_s(self, mode: HostStep) -> float:
        """The step's time with the host step run as `mode` says."""
        return {
            HostStep.SEQUENTIAL: self.sequential_s,
            HostStep.OVERLAPPED: self.overlapped_s,
            HostStep.IN_BACKWARD: self.in_backward_s,
        }[mode]


def offload_step_time(
    *,
    resident_step_s: float,
    offloaded_params: int,
    checkpointed: bool,
    reshard_after_forward: bool = True,
    stored_bytes: int = 4,
    pcie_bytes_per_s: float = PCIE_BYTES_PER_S,
    host_s_per_param: float = HOST_ADAMW_S_PER_PARAM,
    units: int = 1,
    disk_state_bytes: int = 0,
    disk_read_bytes_per_s: float = DISK_READ_BYTES_PER_S,
    disk_write_bytes_per_s: float = DISK_WRITE_BYTES_PER_S,
) -> OffloadTime:
    """The offloaded step's phases from the resident step's time (GPU work alone) and the offload over
    `units` offloaded units (the in-backward step's granularity; 1 is the pessimistic bound);
    `host_s_per_param`: the host AdamW alone (the rates beside the GPU scale with it)."""
    for name, value in (
        ("resident_step_s", resident_step_s),
        ("pcie_bytes_per_s", pcie_bytes_per_s),
        ("host_s_per_param", host_s_per_param),
        ("disk_read_bytes_per_s", disk_read_bytes_per_s),
        ("disk_write_bytes_per_s", disk_write_bytes_per_s),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"offload_step_time: {name}={value!r} must be a positive number")
    if isinstance(offloaded_params, bool) or not isinstance(offloaded_params, int) or offloaded_params < 0:
        raise ValueError(f"offload_step_time: offloaded_params={offloaded_params!r} must be a count (0 or more)")
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise ValueError(f"offload_step_time: units={units!r} must be the number of offloaded units (1 or more)")
    if isinstance(disk_state_bytes, bool) or not isinstance(disk_state_bytes, int) or disk_state_bytes < 0:
        raise ValueError(f"offload_step_time: disk_state_bytes={disk_state_bytes!r} must be a byte count (0 or more)")
    if stored_bytes not in (2, 4):
        raise ValueError(f"offload_step_time: stored_bytes={stored_bytes!r}: use 4 (fp32 masters) or 2")
    # forward : backward = 1 : 2 of the FLOPs, 1 : 3 with every block's forward recomputed
    forward = resident_step_s / (4 if checkpointed else 3)
    backward = resident_step_s - forward
    shard_s = offloaded_params * stored_bytes / pcie_bytes_per_s
    h2d_backward = shard_s if reshard_after_forward else 0.0
    host = offloaded_params * host_s_per_param
    beside_forward, beside_backward = host * BESIDE_FORWARD, host * BESIDE_BACKWARD
    backward_phase = max(backward, h2d_backward + shard_s)  # the re-gathers, then the gradients (d2h)
    forward_phase = max(forward, shard_s)
    in_backward = max(
        forward_phase + backward_phase + beside_backward / units, backward_phase / units + beside_backward + forward
    )
    disk = disk_seconds(
        disk_state_bytes, read_bytes_per_s=disk_read_bytes_per_s, write_bytes_per_s=disk_write_bytes_per_s
    )
    return OffloadTime(
        forward_s=forward,
        backward_s=backward,
        host_step_s=beside_forward,
        in_backward_host_step_s=beside_backward,
        sequential_host_step_s=host * DTENSOR_FACTOR,
        h2d_forward_s=shard_s,
        h2d_backward_s=h2d_backward,
        d2h_s=shard_s,
        disk_s=disk,
        sequential_s=forward_phase + backward_phase + host * DTENSOR_FACTOR + disk,
        overlapped_s=max(max(forward_phase, beside_forward) + backward_phase, disk),
        in_backward_s=(in_backward if offloaded_params else forward + backward),
    )
