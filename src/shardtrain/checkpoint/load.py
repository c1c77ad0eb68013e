"""`load_checkpoint`: find the checkpoint, check it fits `state`, load every entry in place.

Loading needs no communication: each rank reads the ranges its shards hold from whichever files
contain them. One agreement at the end makes every rank raise if any rank failed (a corrupt file
is seen only by the ranks that read it), so no rank trains on while another stopped.
"""

from __future__ import annotations

import os
from typing import Any

from .collective import Comm
from .commit import resolve
from .entries import Entries, classify
from .format import PARAMS, read_metadata, short_list
from .full import FullSource
from .objects import restore_objects
from .optim_state import restore_optimizer
from .sharded import sharded_source
from .source import restore_module
from .tensorfile import CheckpointFiles
from .values import decode

_KIND_NAMES = {
    "modules": "a sharded module",
    "optimizers": "a sharded optimizer",
    "objects": "a plain object (state_dict)",
}
_KIND_FIXES = {
    "modules": "pass the model after st.shard(...) (or convert the checkpoint with `shardtrain convert`)",
    "optimizers": "pass the optimizer built over the sharded model's parameters, with that model in state",
    "objects": "pass an object with state_dict()/load_state_dict() under this key",
}


def load_checkpoint(
    path: str | os.PathLike, state: dict[str, Any], *, strict: bool = True, params: str = "all"
) -> dict[str, Any]:
    """Load the checkpoint at `path` into the objects of `state`, in place; return its plain values.

    `path` is a checkpoint directory, or a directory whose `latest` pointer names one. A sharded
    checkpoint written at any world size loads at this one. With `strict`, every object of `state`
    must be in the checkpoint and every model and optimizer must match it name for name and shape for
    shape; `strict=False` loads what matches. `params="trainable"` loads only the models' parameters
    that require gradients (the others keep their values): the way to load a checkpoint saved with
    `save_checkpoint(..., params="trainable")`. Every rank of the model's process group must call it.
    """
    if params not in PARAMS:
        raise ValueError(f"params={params!r}: use 'all' (every parameter) or 'trainable' (those requiring gradients)")
    entries = classify(state)
    comm = Comm.over(entries.comm_group)
    values: dict[str, Any] = {}

    def load() -> None:
        directory = resolve(path)
        metadata = read_metadata(directory)
        _check_entries(metadata, entries, strict=strict)
        with CheckpointFiles(directory, metadata["files"]) as files:
            sources = {key: _source(files, key, metadata) for key in entries.modules if key in metadata["modules"]}
            for key, source in sources.items():
                restore_module(entries.modules[key], key, source, strict=strict, params=params)
            for name, sharded in entries.optimizers.items():
                if name in metadata["optimizers"] and sharded.module in sources:
                    restore_optimizer(
                        sharded, name, metadata["optimizers"][name], sources[sharded.module], strict=strict
                    )
            objects = {k: o for k, o in entries.objects.items() if k in metadata["objects"]}
            restore_objects(files, objects, rank=comm.rank, same_world=metadata["world_size"] == comm.world)
        values.update(decode(metadata["values"]))

    comm.everyone(load)
    return values


def _source(files: CheckpointFiles, key: str, metadata: dict[str, Any]):
    record = metadata["modules"][key]
    if metadata["kind"] == "full":
        return FullSource(files, key, record)
    return sharded_source(files, key, record, version=metadata["version"])


def _check_entries(metadata: dict[str, Any], entries: Entries, *, strict: bool) -> None:
    """Each object of `state` must be saved as the same kind of thing (and, with strict, be saved)."""
    missing = []
    kinds = (("modules", entries.modules), ("optimizers", entries.optimizers), ("objects", entries.objects))
    for kind, wanted in kinds:
        for key in wanted:
            if key in metadata[kind]:
                continue
            saved_as = next((k for k in _KIND_NAMES if key in metadata[k]), None)
            if saved_as is not None:
                raise ValueError(
                    f"state[{key!r}] is {_KIND_NAMES[kind]}, but the checkpoint saved {key!r} as "
                    f"{_KIND_NAMES[saved_as]}; {_KIND_FIXES[saved_as]}"
                )
            missing.append(key)
    for name, sharded in entries.optimizers.items():
        saved = metadata["optimizers"].get(name)
        if saved is not None and saved["module"] != sharded.module:
            raise ValueError(
                f"optimizer state[{name!r}] was saved over module {saved['module']!r} but now holds the "
                f"parameters of state[{sharded.module!r}]; pass the model under {saved['module']!r}"
            )
    if strict and missing:
        held = sorted(set(metadata["modules"]) | set(metadata["optimizers"]) | set(metadata["objects"]))
        raise ValueError(
            f"the checkpoint has no {short_list(missing)}; it holds {short_list(held)} and values "
            f"{short_list(sorted(metadata['values']))}; pass strict=False to load the rest"
        )
