"""`save_checkpoint`: snapshot, write every rank's files into a staging directory, commit.

Agreed steps (see collective.py): (1) every rank snapshots its optimizers and object state and
checks they can be stored; (2) rank 0 creates the staging directory; (3) every rank writes its rank
file and its modules (sharded: its own shards, optimizer state included; full: all ranks gather,
rank 0 writes); (4) full: the optimizers' state likewise; (5) rank 0 writes metadata.json and
commits. A failure on any rank in any step raises on every rank, leaves the last checkpoint and
`latest` untouched and removes this save's staging directory (so a full disk is not left fuller).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import __version__
from ..core.held import tp_coordinates
from ..core.shard_module import runtime_of
from . import commit
from .collective import Comm
from .entries import Entries, classify
from .format import FORMAT_NAME, FORMAT_VERSION, KINDS, METADATA_FILE, PARAMS, dtype_code, params_record, write_metadata
from .full import write_full_modules, write_full_optimizers
from .objects import rank_payload, write_rank_file
from .optim_state import OptimizerSnapshot, snapshot
from .sharded import write_shards
from .tensorfile import FileRecord, writing
from .this_rank import persistent_buffers
from .values import encode


def save_checkpoint(
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    format: str = "sharded",
    keep_last: int | None = None,
    params: str = "all",
) -> Path:
    """Save `state` to the checkpoint directory `path`, atomically; return `path`.

    Objects (sharded modules, their optimizers, anything with state_dict/load_state_dict) are saved
    by reference, other values as JSON metadata. `format="sharded"`: every rank writes its own
    shards, loadable at any world size. `format="full"`: whole tensors, the weights loadable into the
    plain model with `model.load_state_dict(safetensors.torch.load_file(path/"model.safetensors"))`.
    `<parent>/latest` is pointed at `path`; `keep_last=k` keeps the k newest checkpoints of the parent.
    `params="trainable"` saves only the parameters that require gradients (every rank's rows of them,
    e.g. LoRA adapters over a frozen base that is reloaded from its pretrained files); the metadata
    records it, and loading needs `load_checkpoint(..., params="trainable")`.
    Every rank of the model's process group must call it.
    """
    if format not in KINDS:
        raise ValueError(f"format={format!r}: use one of {KINDS}")
    if params not in PARAMS:
        raise ValueError(f"params={params!r}: use 'all' (every parameter) or 'trainable' (those requiring gradients)")
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r}: use a positive int (checkpoints kept), or None to keep all")
    final = Path(path)
    entries = classify(state)
    comm = Comm.over(entries.comm_group)

    def prepare():
        return {name: snapshot(o) for name, o in entries.optimizers.items()}, rank_payload(entries.objects)

    def begin():
        values = {k: encode(v, f"state[{k!r}]") for k, v in entries.values.items()}
        token = commit.new_token()
        with writing(commit.staging_dir(final, token)):
            commit.begin_staging(final, token)
        return token, values

    snapshots, payload = comm.everyone(prepare)
    token, values = comm.on_rank0(begin)
    staging = commit.staging_dir(final, token)

    def write_modules():
        records = write_rank_file(staging, comm.rank, payload)
        if format == "sharded":
            records.update(write_shards(entries, snapshots, staging, params=params))
        else:
            records.update(write_full_modules(entries, staging, rank=comm.rank, params=params))
        return records

    def write_optimizers():
        records = write_full_optimizers(entries, snapshots, staging, rank=comm.rank) if format == "full" else {}
        if commit.before_commit_hook is not None:
            commit.before_commit_hook(staging, comm.rank)
        return records

    def finish(per_rank):
        files = {name: record for records in per_rank for name, record in sorted(records.items())}
        metadata = _metadata(
            entries, snapshots, kind=format, world=comm.world, values=values, files=files, params=params
        )
        with writing(staging / METADATA_FILE):
            write_metadata(staging, metadata)
        commit.commit(staging, final, keep_last=keep_last)

    try:
        # Note [Errors inside a loop of collectives] (docs/design.md): each step ends with every rank
        # out of its collectives, and raises on every rank if any rank failed in it.
        modules = comm.everyone(lambda: _records(write_modules()), gather=True)
        optimizers = comm.everyone(lambda: _records(write_optimizers()), gather=True)
        comm.on_rank0(lambda: finish([*modules, *optimizers]))
    except Exception:
        if comm.rank == 0:  # every rank has stopped writing: the partial files can go
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def _records(records: dict[str, FileRecord]) -> dict[str, dict[str, Any]]:
    return {name: asdict(record) for name, record in records.items()}


def _metadata(
    entries: Entries,
    snapshots: dict[str, OptimizerSnapshot],
    *,
    kind: str,
    world: int,
    values: dict[str, Any],
    files: dict[str, Any],
    params: str,
) -> dict[str, Any]:
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "kind": kind,
        "world_size": world,
        "created_ns": time.time_ns(),
        "shardtrain_version": __version__,
        "torch_version": torch.__version__,
        "modules": {key: _module_record(module, params=params) for key, module in entries.modules.items()},
        "optimizers": {name: snap.record(name) for name, snap in snapshots.items()},
        "objects": sorted(entries.objects),
        "values": values,
        "files": files,
    }


def _module_record(module: nn.Module, *, params: str) -> dict[str, Any]:
    runtime = runtime_of(module)
    record = {
        "saved": params,
        "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "strategy": runtime.strategy.value,
        "shard_world": runtime.comm.shard_world,
        "replicate_world": runtime.comm.replicate_world,
        "params": params_record(runtime, params=params),
        "buffers": {
            name: {"shape": list(b.shape), "dtype": dtype_code(b.dtype)}
            for name, b in persistent_buffers(module).items()
        },
    }
    _, tp_world = tp_coordinates(runtime)
    if tp_world > 1:
        record["tp_world"] = tp_world  # shard files are (shard, tp rank) pairs: docs/checkpoint-format.md
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if callable(to_json) and hasattr(config, "model_type"):
        record["hf_config"] = json.loads(to_json())  # a transformers model: `convert` writes config.json
    return record
