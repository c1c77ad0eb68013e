"""Predicted step time of a CPU-offloaded configuration, with the host optimizer step in sequence or
overlapped with the GPU's work (docs/design.md, Note [Overlapped host step]).

Four resources work per step: the GPU (forward, then backward), the host AdamW over the offloaded
parameters, and PCIe each way. What runs beside what:

    sequential   max(forward, H2D of the forward's gathers)
                 + max(backward, H2D of the backward's re-gathers + D2H of the gradients)
                 + host step over DTensors
    overlapped   max(forward, H2D of the forward's gathers, host step)
                 + max(backward, H2D of the backward's re-gathers + D2H of the gradients)
    in backward  max(forward phase + backward phase + host step / units,
                     host step + backward phase / units)

Overlapped, the host step of unit k runs during the next forward just before unit k is needed, so the
forward takes as long as the slowest of the three; the backward cannot hide it (clipping's norm, the
non-finite verdict and the last micro-batch are only known at its end). In backward
(CPUOffload(step_in_backward=True), a loop with nothing global between backward and step()), each
unit steps once its gradients landed: the host starts a unit's share of the backward phase after it
begins and runs on through the next forward, so the step is bounded by the GPU's phases or by the host
step, whichever is longer; the first unit of the next forward gets its gradients last and its step is
always exposed (one unit's share, the units assumed equal). In backward the host-to-device
re-gathers and the device-to-host gradient copies share the link (measured 47.7 GB/s each way at once
on an H200 host, about the one-way rate): they are counted one after the other, at the one-way rate.

Defaults, measured on one H200 host (16 cores, PCIe Gen5 x16): pinned copies 54.5
GB/s, fused AdamW 0.185 ns per fp32 parameter with 16 threads over plain tensors (283 ms at 1.5B,
`benchmarks/optimizer_step.py`), 16% more over DTensors (329 ms), which the user's own `step()`
steps in sequence and the overlapped step avoids (it steps the local rows). With these, 1.5B fully
offloaded is predicted at 0.666 s in sequence (measured 0.660 s). The GPU's share: forward a third of the resident step, backward the
rest (half of it again when every block is checkpointed: the recomputed forward). The offloaded shards
are copied in their stored dtype (the cast runs on the device).

With the disk tier (Note [Disk tier]) the offloaded optimizer state is read and written once per step
through the unit steps' pipeline; one device serves both directions, so the disk alone takes
`disk_state_bytes` / read bandwidth + the same / write bandwidth, and the step takes the longer of
that and the overlapped step above (read-ahead and write-behind run beside the GPU and the host
AdamW). Defaults, measured on an H200 host's virtual disk: 8 threads of O_DIRECT `preadv` 1.33
GB/s, O_DIRECT writes 1.43 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass

PCIE_BYTES_PER_S = 54.5e9
HOST_ADAMW_S_PER_PARAM = 0.185e-9
DTENSOR_FACTOR = 329 / 283  # the same fused AdamW over DTensors: their dispatch
DISK_READ_BYTES_PER_S = 1.33e9
DISK_WRITE_BYTES_PER_S = 1.43e9


@dataclass(frozen=True, kw_only=True)
class OffloadTime:
    """The predicted phases of one step, in seconds."""

    forward_s: float  # GPU forward
    backward_s: float  # GPU backward (with the recomputation when checkpointed)
    host_step_s: float  # host AdamW over the offloaded parameters' local rows (overlapped)
    sequential_host_step_s: float  # the same over the DTensors, inside the user's step()
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
    `units` offloaded units (the in-backward step's granularity; 1 is the pessimistic bound)."""
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
    backward_phase = max(backward, h2d_backward + shard_s)  # the re-gathers, then the gradients (d2h)
    forward_phase = max(forward, shard_s)
    in_backward = max(forward_phase + backward_phase + host / units, host + backward_phase / units)
    disk = disk_state_bytes / disk_read_bytes_per_s + disk_state_bytes / disk_write_bytes_per_s
    return OffloadTime(
        forward_s=forward,
        backward_s=backward,
        host_step_s=host,
        sequential_host_step_s=host * DTENSOR_FACTOR,
        h2d_forward_s=shard_s,
        h2d_backward_s=h2d_backward,
        d2h_s=shard_s,
        disk_s=disk,
        sequential_s=forward_phase + backward_phase + host * DTENSOR_FACTOR + disk,
        overlapped_s=max(max(forward_phase, host) + backward_phase, disk),
        in_backward_s=(in_backward if offloaded_params else forward + backward),
    )
