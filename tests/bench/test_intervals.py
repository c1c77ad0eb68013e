"""Interval arithmetic and the profile breakdown, on synthetic intervals and trace events."""

import pytest

from shardtrain.bench.intervals import difference, total, union
from shardtrain.bench.profile import breakdown_from_events, short_kernel_name


def test_union_merges_overlapping_and_touching_and_drops_empty():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9), (8, 8.5)]) == [(0, 4), (5, 7), (8, 8.5)]


def test_difference_cuts_holes_and_edges():
    a = [(0, 10), (20, 30)]
    b = [(2, 3), (5, 6), (9, 22), (25, 26), (29, 40)]
    assert difference(a, b) == [(0, 2), (3, 5), (6, 9), (22, 25), (26, 29)]
    assert difference(a, []) == a
    assert difference([], b) == []
    assert difference([(0, 1)], [(-5, 5)]) == []


def test_total_counts_overlap_once():
    assert total([(0, 4), (2, 6), (10, 11)]) == 7


def kernel(name, ts, dur, stream, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "device": 0}}


def test_breakdown_partitions_the_window():
    # Over 100 µs (two steps): compute on stream 7 in [0, 40), [60, 90) and [99, 100) (a memcpy on
    # the compute stream counts as compute); NCCL on stream 20 in [30, 55): 10 hidden, 15 exposed;
    # a cast on stream 21 in [50, 65): 5 under NCCL, 5 under compute, 5 exposed; idle: [90, 99).
    events = [
        kernel("sm90_xmma_gemm", 0, 35, 7),
        kernel("memcpy HtoD", 35, 5, 7, cat="gpu_memcpy"),
        kernel("ampere_gemm", 60, 30, 7),
        kernel("ncclDevKernel_AllGather_RING_LL", 30, 25, 20),
        kernel("direct_copy_kernel_cuda", 50, 15, 21),
        kernel("cpu_op_ignored", 0, 100, 7, cat="cpu_op"),
        kernel("late", 99, 1, 7),
    ]
    b = breakdown_from_events(events, steps=2)
    assert b.step_ms == pytest.approx(100 / 2 / 1000)
    assert b.compute_ms == pytest.approx(71 / 2 / 1000)
    assert b.exposed_comm_ms == pytest.approx(15 / 2 / 1000)
    assert b.exposed_copy_ms == pytest.approx(5 / 2 / 1000)
    assert b.idle_ms == pytest.approx(9 / 2 / 1000)
    assert b.comm_ms == pytest.approx(25 / 2 / 1000)
    assert b.collectives == 0.5  # one NCCL kernel in two steps
    assert b.beside_comm_ms == pytest.approx(10 / 2 / 1000)  # compute in [30, 40) ran beside it
    assert b.compute_ms + b.exposed_comm_ms + b.exposed_copy_ms + b.idle_ms == pytest.approx(b.step_ms)
    # The compute stream's gaps, in time order, with what overlapped them most.
    assert [(g.at_ms, g.ms, g.during) for g in b.gaps] == [
        (pytest.approx(0.040), pytest.approx(0.020), ("nccl AllGather", "direct_copy_kernel_cuda")),
        (pytest.approx(0.090), pytest.approx(0.009), ()),
    ]


def test_short_kernel_names():
    assert short_kernel_name("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "nccl SendRecv"
    assert (
        short_kernel_name(
            "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::"
            "(anonymous namespace)::OpaqueType<2u>, unsigned int>(int)"
        )
        == "CatArrayBatchedCopy"
    )
    assert (
        short_kernel_name("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT")
        == "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT"
    )
    assert short_kernel_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"


def test_breakdown_without_device_events_is_none():
    assert breakdown_from_events([kernel("aten::mm", 0, 10, 0, cat="cpu_op")], steps=1) is None
