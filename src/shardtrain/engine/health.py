"""Heartbeats and failure reports in the process group's store, to say which rank a job waits for.

A collective that fails tells a rank only that a peer did not answer, not which peer or why. So each
rank writes a heartbeat once per step and a one-line report when it fails into the default group's
key-value store, and `explain` reads them back to name the culprit; every store access is best effort
(None where the store is gone). What it tells apart: docs/design.md, Note [Heartbeats].
"""

from __future__ import annotations

import json
import os
import time

import torch.distributed as dist

# Keys per attempt: under torchrun --max-restarts the store outlives a failed attempt and its reports.
_ATTEMPT = f"shardtrain/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
_BEAT, _FAILED, _WAITING = f"{_ATTEMPT}beat/", f"{_ATTEMPT}failed/", f"{_ATTEMPT}waiting/"
GRACE_S = 1.5  # how long a timed-out rank waits for the other waiting ranks to say so
_TIMED_OUT = ("timed out", "timeout")  # Gloo: "Timed out waiting 5000ms ...", "Application timeout caused ..."
_PEER_GONE = ("by peer", "Broken pipe", "Connection refused")


def _store():
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store()


def _put(key: str, value: dict) -> None:
    store = _store()
    if store is not None:
        try:
            store.set(key, json.dumps(value))
        except Exception:
            pass


def _read(prefix: str, ranks: list[int]) -> dict[int, dict]:
    """The values under `prefix<rank>` that exist, without waiting for the others."""
    store, found = _store(), {}
    for rank in ranks:
        key = f"{prefix}{rank}"
        try:
            if store is not None and store.check([key]):
                found[rank] = json.loads(store.get(key))
        except Exception:
            return found
    return found


def heartbeat(step: int, phase: str) -> None:
    """Record that this rank reached `phase` of step `step` (one store write; call once per step)."""
    if dist.is_initialized():
        _put(f"{_BEAT}{dist.get_rank()}", {"step": step, "phase": phase, "time": time.time()})


def report_failure(message: str) -> None:
    """Record why this rank is stopping, for its peers' `explain` (call before exiting)."""
    if dist.is_initialized():
        first_line = message.splitlines()[0] if message else ""
        _put(f"{_FAILED}{dist.get_rank()}", {"message": first_line, "time": time.time()})


def explain(error: BaseException, *, timeout_s: float | None) -> str | None:
    """Why this rank's collective raised `error`, naming the rank responsible; None when unknown."""
    if _store() is None:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    others = [r for r in range(world) if r != rank]
    text = str(error)
    failed = _read(_FAILED, others)
    if not failed and any(sign in text.lower() for sign in _TIMED_OUT):
        _put(f"{_WAITING}{rank}", {"time": time.time()})
        time.sleep(GRACE_S)
        failed = _read(_FAILED, others)
        if not failed:
            return _laggards(others, timeout_s)
    if failed:
        first = min(failed, key=lambda r: failed[r]["time"])
        return f"rank {first} failed: {failed[first]['message']}"
    if any(sign in text for sign in _PEER_GONE):
        return (
            "a peer rank exited without reporting an error (killed, out of memory, or a crash outside Python): "
            + text.splitlines()[0][:200]
        )
    return None


def _laggards(others: list[int], timeout_s: float | None) -> str | None:
    waiting = _read(_WAITING, others)
    behind = [r for r in others if r not in waiting]
    if not behind:
        return None
    beats = _read(_BEAT, behind)
    now = time.time()
    where = "; ".join(
        f"rank {r} last reported step {beats[r]['step']} ({beats[r]['phase']}) {now - beats[r]['time']:.1f} s ago"
        if r in beats
        else f"rank {r} never reported a heartbeat"
        for r in behind
    )
    names = ", ".join(map(str, behind))
    limit = f"engine.timeout={timeout_s:g}s" if timeout_s is not None else "the collective timeout"
    return (
        f"rank{'s' if len(behind) > 1 else ''} {names} did not arrive at a collective within {limit} ({where}); "
        "it is stuck outside the collectives or slow: raise --engine.timeout if it is only slow"
    )
