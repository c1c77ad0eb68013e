"""train/startup.py: the clock adds each phase's seconds, and the process's age comes from /proc."""

import time

import pytest

from shardtrain.train.startup import StartupClock, process_age_s


def test_phases_add_up_and_a_phase_marked_twice_sums():
    clock = StartupClock()
    time.sleep(0.05)
    clock.mark("model")
    time.sleep(0.02)
    clock.mark("data")
    time.sleep(0.03)
    clock.mark("model")
    record = clock.record(step=1)
    assert record["kind"] == "startup" and record["step"] == 1
    assert record["model_s"] == pytest.approx(0.08, abs=0.03) and record["data_s"] == pytest.approx(0.02, abs=0.02)
    parts = [v for k, v in record.items() if k.endswith("_s") and k != "total_s"]
    assert record["total_s"] == pytest.approx(sum(parts), abs=0.002)


def test_the_process_age_counts_from_the_process_start():
    age = process_age_s()
    assert age is not None and 0 < age < 24 * 3600  # this test process started before it, today
    time.sleep(0.1)
    later = process_age_s()
    assert later is not None and later - age == pytest.approx(0.1, abs=0.05)
