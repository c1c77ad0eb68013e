"""Policies: CPUOffload's unit selection and its bad inputs."""

import pytest

import shardtrain as st


def test_partial_offload_selects_whole_units_from_the_end_of_the_plan():
    sizes = [40, 10, 10, 10, 10, 20]  # 100 parameters in plan order; the root (40) first, the head (20) last
    assert st.CPUOffload().select(sizes) == [True] * 6
    assert st.CPUOffload(fraction=0.5).select(sizes) == [False, False, True, True, True, True]
    assert st.CPUOffload(fraction=0.51).select(sizes) == [False, True, True, True, True, True]
    assert st.CPUOffload(fraction=0.01).select(sizes) == [False] * 5 + [True]


@pytest.mark.parametrize("fraction", [0, 0.0, -0.5, 1.5, True, "half"])
def test_offload_fraction_must_be_a_share(fraction):
    with pytest.raises(ValueError, match=r"fraction=.*\(0, 1\].*cpu_offload=False"):
        st.CPUOffload(fraction=fraction)


def test_cpu_offload_forms():
    from shardtrain.policy import parse_cpu_offload

    assert parse_cpu_offload(False) is None and parse_cpu_offload(None) is None
    assert parse_cpu_offload(True) == st.CPUOffload()
    assert parse_cpu_offload(0.25) == st.CPUOffload(fraction=0.25)
    with pytest.raises(TypeError, match=r"cpu_offload='yes'.*fraction"):
        parse_cpu_offload("yes")


def test_offload_host_threads(monkeypatch):
    assert st.CPUOffload(threads=3).host_threads() == 3
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert st.CPUOffload().host_threads() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert st.CPUOffload().host_threads() == 1
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="threads="):
            st.CPUOffload(threads=bad)


def test_offloaded_units_reshard_as_the_strategy_unless_told():
    assert st.CPUOffload().reshards_after_forward(strategy_reshards=True)
    assert not st.CPUOffload().reshards_after_forward(strategy_reshards=False)
    kept = st.CPUOffload(reshard_after_forward=False)
    assert not kept.reshards_after_forward(strategy_reshards=True)
    assert st.CPUOffload(reshard_after_forward=True).reshards_after_forward(strategy_reshards=False)
    with pytest.raises(TypeError, match=r"reshard_after_forward='no'.*True, False, or None"):
        st.CPUOffload(reshard_after_forward="no")  # type: ignore[arg-type]
