"""Records: one `RunRecord` per torchrun launch, one `Row` per (size, engine) after aggregation.

A row pools the timed steps of all its successful repeats: tokens/s per GPU median, min and max
over those steps; memory is the highest peak seen; the loss column is the first run's loss at its
last timed step (every engine trains on the same data from the same weights, so the columns must
agree). Rows of one size are then compared with the baseline engine (torch FSDP2) and the ideal step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .metrics import Stats, mfu, model_flops_per_token, tokens_per_second
from .registry import BASELINE, IDEAL, resolve_engine
from .spec import RunSpec

OK = "ok"


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """What one launch of the worker processes gave: the worker's result, or why there is none."""

    spec: RunSpec
    nproc: int
    repeat: int
    status: str  # "ok", "out of memory", "failed", "timed out"
    wall_s: float
    result: dict | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["spec"] = asdict(self.spec)
        return out


@dataclass(frozen=True, kw_only=True)
class Row:
    size: str
    engine: str
    label: str
    spec: RunSpec
    nproc: int
    status: str
    runs: int  # successful runs pooled into the numbers
    failed_runs: int
    tokens_per_s_gpu: Stats | None = None
    tokens_per_s_all: float | None = None  # median × ranks: the whole job's throughput
    step_ms: float | None = None  # median
    flops_per_token: float = 0.0
    peak_tflops: float | None = None
    mfu: float | None = None
    allocated_gib: float | None = None
    reserved_gib: float | None = None
    rss_gib: float | None = None
    loss_step: int | None = None
    loss: float | None = None
    losses: tuple[float, ...] = ()
    vs_baseline: float | None = None
    over_ideal: float | None = None  # step time / ideal step time
    breakdown: dict | None = None
    trace: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict:
        out = asdict(self)
        out["spec"] = asdict(self.spec)
        out["tokens_per_s_gpu"] = self.tokens_per_s_gpu.to_dict() if self.tokens_per_s_gpu else None
        return out


def aggregate(records: list[RunRecord], *, peak_tflops: float | None) -> list[Row]:
    """Rows in the order their (size, engine) first ran, the ideal step last in its size; compared
    within each size."""
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for record in records:
        groups.setdefault((record.spec.size, record.spec.engine), []).append(record)
    sizes = list(dict.fromkeys(size for size, _ in groups))
    order = sorted(groups, key=lambda key: (sizes.index(key[0]), key[1] == IDEAL))
    rows = [_row(groups[key], peak_tflops=peak_tflops) for key in order]
    return [_compare(row, rows) for row in rows]


def _row(records: list[RunRecord], *, peak_tflops: float | None) -> Row:
    first = records[0]
    spec = first.spec
    good = [r for r in records if r.status == OK and r.result]
    bad = [r for r in records if r not in good]
    base = dict(
        size=spec.size,
        engine=spec.engine,
        label=resolve_engine(spec.engine).label,
        spec=spec,
        nproc=first.nproc,
        runs=len(good),
        failed_runs=len(bad),
        flops_per_token=model_flops_per_token(spec),
        peak_tflops=peak_tflops,
    )
    if not good:
        return Row(status=bad[0].status, error=bad[0].error, **base)
    results = [r.result for r in good]
    base["label"] = results[0].get("label", base["label"])  # what the run decided (shardtrain-auto)
    per_step = [
        t
        for res in results
        for t in tokens_per_second(tokens_per_step=spec.tokens_per_rank_step, step_ms=res["step_ms"])
    ]
    stats = Stats.of(per_step)
    losses = tuple(results[0]["losses"])
    profiled = next((res for res in results if res.get("breakdown") or res.get("trace")), {})
    return Row(
        status=OK,
        tokens_per_s_gpu=stats,
        tokens_per_s_all=stats.median * results[0]["world"],
        step_ms=spec.tokens_per_rank_step * 1000.0 / stats.median,
        mfu=None
        if peak_tflops is None
        else mfu(flops_per_token=base["flops_per_token"], tokens_per_s_per_gpu=stats.median, peak_tflops=peak_tflops),
        allocated_gib=_max(res["memory_gib"]["allocated"] for res in results),
        reserved_gib=_max(res["memory_gib"]["reserved"] for res in results),
        rss_gib=_max(res["memory_gib"]["rss"] for res in results),
        loss_step=len(losses) or None,
        loss=losses[-1] if losses else None,
        losses=losses,
        breakdown=profiled.get("breakdown"),
        trace=profiled.get("trace"),
        error=bad[0].error if bad else None,
        **base,
    )


def _compare(row: Row, rows: list[Row]) -> Row:
    if not row.ok:
        return row
    same_size = {r.engine: r for r in rows if r.size == row.size and r.ok}
    baseline, ideal = same_size.get(BASELINE), same_size.get(IDEAL)
    return replace(
        row,
        vs_baseline=row.tokens_per_s_gpu.median / baseline.tokens_per_s_gpu.median if baseline else None,
        over_ideal=ideal.tokens_per_s_gpu.median / row.tokens_per_s_gpu.median if ideal else None,
    )


def _max(values) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None
