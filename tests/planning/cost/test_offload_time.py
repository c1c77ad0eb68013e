"""planning/cost/offload_time.py: the offloaded step's phases (in sequence, overlapped, in backward, with the disk
tier), and the planner pricing offload with them."""

import pytest

import shardtrain as st
from shardtrain.planning.cost.candidates import offload_work, predicted_time
from shardtrain.planning.cost.offload_time import offload_step_time


def test_one_gpu_figures():
    """1.5B fully offloaded on one H200 (resident step 0.166 s): overlapped, the host step (381 ms
    beside the forward, as measured) bounds the forward and the backward stays bound by the copies
    both ways: within 2% of the 0.606 s measured; in sequence (the host step alone, over DTensors)
    within 6% of the 0.700 s measured."""
    t = offload_step_time(resident_step_s=0.166, offloaded_params=1_532_037_120, checkpointed=False)
    assert t.host_step_s == pytest.approx(0.381, abs=1e-3)
    assert t.sequential_host_step_s == pytest.approx(0.329, abs=1e-3)
    assert t.h2d_forward_s == pytest.approx(1_532_037_120 * 4 / 54.5e9)
    assert t.overlapped_s == pytest.approx(t.host_step_s + t.h2d_backward_s + t.d2h_s)
    assert t.overlapped_s == pytest.approx(0.606, rel=0.02)
    assert t.sequential_s == pytest.approx(0.700, rel=0.06)
    assert 1.05 < t.speedup < 1.15


def test_in_backward_at_1_5b_is_bounded_by_the_host_step_beside_the_gpu():
    """30 units: the host step beside backward's copies (0.505 s, 0.33 ns per parameter) outlasts the
    GPU's phases (0.112 + 0.225 s), so the step is a unit's share of the backward, the host step, then
    the forward: within 2% of the 0.558 s measured (15 host threads). A fast host leaves the GPU's
    phases and one unit's step exposed instead."""
    t = offload_step_time(resident_step_s=0.166, offloaded_params=1_532_037_120, checkpointed=False, units=30)
    backward = max(t.backward_s, t.h2d_backward_s + t.d2h_s)
    phases = max(t.forward_s, t.h2d_forward_s) + backward
    assert t.in_backward_host_step_s == pytest.approx(0.5056, abs=1e-3)
    assert t.in_backward_s == pytest.approx(backward / 30 + t.in_backward_host_step_s + t.forward_s)
    assert t.in_backward_s == pytest.approx(0.558, rel=0.02)
    fast_host = offload_step_time(
        resident_step_s=0.166, offloaded_params=1_532_037_120, checkpointed=False, units=30, host_s_per_param=0.05e-9
    )
    assert fast_host.in_backward_s == pytest.approx(phases + fast_host.in_backward_host_step_s / 30)  # GPU-bound


def test_nothing_offloaded_is_the_resident_step_and_overlap_never_loses():
    t = offload_step_time(resident_step_s=1.0, offloaded_params=0, checkpointed=True)
    assert t.sequential_s == t.overlapped_s == t.in_backward_s == pytest.approx(1.0)
    for params in (10**8, 10**9, 10**10):
        for ckpt in (False, True):
            for units in (4, 40):  # one unit (the bound) steps after backward, as in sequence
                t = offload_step_time(resident_step_s=1.0, offloaded_params=params, checkpointed=ckpt, units=units)
                assert t.in_backward_s <= t.sequential_s
                assert t.overlapped_s <= t.sequential_s
                assert t.sequential_s - t.overlapped_s <= t.sequential_host_step_s * (1 + 1e-9)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(resident_step_s=0.0), "resident_step_s=0.0 must be a positive number"),
        (dict(offloaded_params=-1), "offloaded_params=-1 must be a count"),
        (dict(stored_bytes=3), "stored_bytes=3: use 4"),
        (dict(units=0), "units=0 must be the number of offloaded units"),
    ],
)
def test_bad_input_names_the_value(kwargs, message):
    args = dict(resident_step_s=1.0, offloaded_params=10, checkpointed=False) | kwargs
    with pytest.raises(ValueError, match=message):
        offload_step_time(**args)


def test_disk_tier_bound():
    """The state read and written once per step on one disk: the step is the longer of that and the
    overlapped step; 24.4 GB at the tier's 1.77 / 2.54 GB/s on the H200 host is 23.4 s, at 25 GB/s both
    ways 1.95 s."""
    base = offload_step_time(resident_step_s=1.0, offloaded_params=3 * 10**9, checkpointed=True)
    state = 24_400_000_000
    t = offload_step_time(resident_step_s=1.0, offloaded_params=3 * 10**9, checkpointed=True, disk_state_bytes=state)
    assert t.disk_s == pytest.approx(state / 1.77e9 + state / 2.54e9) == pytest.approx(23.4, abs=0.1)
    assert t.overlapped_s == pytest.approx(max(base.overlapped_s, t.disk_s))
    fast = offload_step_time(
        resident_step_s=1.0,
        offloaded_params=3 * 10**9,
        checkpointed=True,
        disk_state_bytes=state,
        disk_read_bytes_per_s=25e9,
        disk_write_bytes_per_s=25e9,
    )
    assert fast.disk_s == pytest.approx(1.952) and fast.overlapped_s == pytest.approx(max(base.overlapped_s, 1.952))
    with pytest.raises(ValueError, match="disk_state_bytes=-1 must be a byte count"):
        offload_step_time(resident_step_s=1.0, offloaded_params=1, checkpointed=False, disk_state_bytes=-1)


@pytest.mark.parametrize(
    ("offload", "env", "measured"),
    [
        (st.CPUOffload(), None, 0.606),  # overlapped with the next forward (the default)
        (st.CPUOffload(step_in_backward=True), None, 0.558),  # in backward, 15 host threads
        (st.CPUOffload(), "sequential", 0.700),  # in the user's step(), after backward
    ],
)
def test_the_planner_prices_the_host_step_mode_the_policy_selects(offload, env, measured, monkeypatch):
    """BENCHMARKS.md, 'Offloaded optimizer step': 1.5B on one H200, batch 2 x 4096, everything
    offloaded. The planner's step time (its own resident step, 0.140 s against 0.167 s measured, plus
    this model) for the mode `st.shard` would run, against the measured step."""
    if env:
        monkeypatch.setenv("SHARDTRAIN_HOST_STEP", env)
    estimate = st.estimate_memory("1.5b", world_size=1, seq_len=4096, micro_batch=2, cpu_offload=offload)
    time = predicted_time(estimate, grad_accum=1)
    assert offload_work(estimate).units == 19 and time.disk == 0
    assert time.seconds == pytest.approx(measured, rel=0.06)
