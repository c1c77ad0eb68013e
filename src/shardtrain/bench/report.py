"""The printed tables: one row per (size, engine), then the profile breakdown, then the footnotes.

Plain aligned text, so the output reads the same in a terminal, a log file and a CI artifact.
A row that did not run to the end shows its status ("out of memory", "failed", "timed out") in
place of its throughput.
"""

from __future__ import annotations

from collections.abc import Callable

from .metrics import MFU_FORMULA
from .results import Row

DASH = "—"


def format_table(headers: list[str], body: list[list[str]]) -> str:
    """Columns padded to their widest cell; the first two columns left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in body)])


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return DASH if value is None else f"{value:{spec}}{suffix}"


def results_table(rows: list[Row]) -> str:
    """The main table. On CUDA throughput is per GPU and memory is allocated/reserved; on the CPU
    throughput is per rank and memory is the resident set size."""
    cuda = any(r.spec.device == "cuda" for r in rows)
    loss_step = next((r.loss_step for r in rows if r.loss_step), None)
    memory: list[tuple[str, Callable[[Row], float | None]]] = (
        [("alloc GiB", lambda r: r.allocated_gib), ("reserved GiB", lambda r: r.reserved_gib)]
        if cuda
        else [("peak RSS GiB", lambda r: r.rss_gib)]
    )
    headers = [
        "size",
        "engine",
        "tok/s/GPU" if cuda else "tok/s/rank",
        "min",
        "max",
        "tok/s all",
        "MFU",
        *(name for name, _ in memory),
        "vs FSDP2",
        "step/ideal",
        f"loss@{loss_step or 'N'}",
    ]
    body = []
    for r in rows:
        if not r.ok:
            body.append([r.size, r.label, r.status, *[DASH] * (len(headers) - 3)])
            continue
        t = r.tokens_per_s_gpu
        body.append(
            [
                r.size,
                r.label,
                f"{t.median:,.0f}",
                f"{t.min:,.0f}",
                f"{t.max:,.0f}",
                _fmt(r.tokens_per_s_all, ",.0f"),
                _fmt(None if r.mfu is None else 100 * r.mfu, ".1f", "%"),
                *(_fmt(get(r), ".1f") for _, get in memory),
                _fmt(r.vs_baseline, ".3f"),
                _fmt(r.over_ideal, ".2f"),
                DASH if r.engine == "ideal" else _fmt(r.loss, ".4f"),
            ]
        )
    return format_table(headers, body)


def breakdown_table(rows: list[Row]) -> str | None:
    """Per-step milliseconds (and share of the step) of the profiled rows; None if none was profiled."""
    profiled = [r for r in rows if r.ok and r.breakdown]
    if not profiled:
        return None
    headers = [
        "size",
        "engine",
        "step ms",
        "compute",
        "exposed comm",
        "exposed copies",
        "idle",
        "NCCL total",
        "NCCL kernels",
        "compute beside NCCL",
    ]
    body = []
    for r in profiled:
        b = r.breakdown
        share = (lambda v: f"{v:.1f} ({100 * v / b['step_ms']:.0f}%)") if b["step_ms"] > 0 else (lambda v: f"{v:.1f}")
        body.append(
            [
                r.size,
                r.label,
                f"{b['step_ms']:.1f}",
                share(b["compute_ms"]),
                share(b["exposed_comm_ms"]),
                share(b["exposed_copy_ms"]),
                share(b["idle_ms"]),
                f"{b['comm_ms']:.1f}",
                f"{b.get('collectives', 0.0):.0f}",
                f"{b.get('beside_comm_ms', 0.0):.1f}",
            ]
        )
    return format_table(headers, body)


def gaps_table(rows: list[Row]) -> str | None:
    """The longest compute-stream gaps of each profiled row and what ran meanwhile; None if none."""
    body = []
    for r in rows:
        for gap in (r.breakdown or {}).get("gaps", ()) if r.ok else ():
            body.append(
                [
                    r.size,
                    r.label,
                    f"{gap['at_ms']:.1f}",
                    f"{gap['ms']:.2f}",
                    ", ".join(gap["during"]) or "nothing (waiting for the host)",
                ]
            )
    if not body:
        return None
    return format_table(["size", "engine", "at ms", "gap ms", "running meanwhile"], body)


def footnotes(rows: list[Row]) -> str:
    lines = []
    peaks = {r.peak_tflops for r in rows if r.peak_tflops}
    if peaks:
        lines.append(f"MFU = {MFU_FORMULA}; peak = {', '.join(f'{p:g}' for p in sorted(peaks))} TFLOP/s per GPU")
    for size in dict.fromkeys(r.size for r in rows):
        r = next(r for r in rows if r.size == size)
        s = r.spec
        lines.append(
            f"{size}: {r.flops_per_token / 1e9:.2f} GFLOP/token; batch {s.batch} × seq {s.seq} per rank, "
            f"{r.nproc} ranks, {s.precision}, activation checkpointing {'on' if s.ac else 'off'}, "
            f"{'every Block compiled' if s.compile else 'eager'}, "
            f"{s.warmup} warm-up + {s.steps} timed steps"
        )
    lines.append(
        "tok/s per GPU (per rank on the CPU): median/min/max over all timed steps of all repeats; "
        "tok/s all = median × ranks; "
        "vs FSDP2 = tok/s ratio; step/ideal = step time over the ideal step's (resident params, "
        "no collectives, AdamW on 1/N)"
    )
    lines.append("loss@N: training loss at step N, mean over ranks (same weights and data for every engine)")
    lines.append(
        "units: shardtrain one per Block, the embedding and the output head, plus the root; torch FSDP2 "
        "fully_shard per Block and on the root (fsdp2-split: as shardtrain)"
    )
    lines += [f"{r.size} {r.label}: {r.error}" for r in rows if r.error]
    lines += [f"{r.size} {r.label}: trace {r.trace}" for r in rows if r.trace]
    return "\n".join(lines)


def render(rows: list[Row]) -> str:
    parts = [results_table(rows)]
    breakdown = breakdown_table(rows)
    if breakdown:
        parts += ["", "Step-time breakdown (profiler, rank 0, ms per step):", breakdown]
    gaps = gaps_table(rows)
    if gaps:
        parts += ["", "Longest compute-stream gaps in the profiled steps (rank 0):", gaps]
    parts += ["", footnotes(rows)]
    return "\n".join(parts)
