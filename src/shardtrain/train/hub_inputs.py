"""A run's Hub ids (model.pretrained, each data source's path and eval_path, data.eval_path), fetched once per node before anything reads them.

model.pretrained 'org/name' is replaced by its local snapshot folder, so the model builder, the
tokenizer, the weights loader and a LoRA resume all keep taking a folder. A Hub dataset id stays in
the config (its cache key and messages name it); its snapshot is only fetched here, and every rank
then reads it from the HF cache (data/sources.py). With an engine of several ranks, local rank 0 of
each node downloads first and the others wait at a barrier, then read the cache; every rank reaches
that barrier, so a failure is still each rank's own one-line error, never a wait for a peer.
"""

from __future__ import annotations

import dataclasses

from ..data.hub import hub_snapshot, is_hub_id, resolve_model_source
from .sections import Config


def fetch_hub_inputs(cfg: Config, *, engine=None) -> Config:
    """`cfg` with model.pretrained a local folder and its Hub datasets in the HF cache; ValueError with the fix.
    `engine`: a launched Engine (local rank 0 fetches first), or None in a single process."""
    hub_model = is_hub_id(cfg.model.pretrained)
    sources = cfg.data.source_list()
    keys = ("data",) if not cfg.data.sources else [f"data.sources.{i}" for i in range(len(sources))]
    inputs = [(f"{k}.path", s.path, s.revision) for k, s in zip(keys, sources)]
    inputs += [(f"{k}.eval_path", s.eval_path, None) for k, s in zip(keys, sources)]
    if cfg.data.sources:  # data.eval_path beside data.sources: the whole mix's held-out rows
        inputs.append(("data.eval_path", cfg.data.eval_path, None))
    hub_data = [(key, path, revision) for key, path, revision in inputs if is_hub_id(path)]
    if not hub_model and not hub_data:
        return cfg
    first = engine is None or engine.local_rank == 0
    error: ValueError | None = None
    if first:
        try:
            cfg = _fetched(cfg, hub_data)
        except ValueError as exc:
            error = exc
    if engine is not None:
        engine.barrier()  # the others read what local rank 0 fetched
    if not first:
        cfg = _fetched(cfg, hub_data)
    if error is not None:
        raise error
    return cfg


def _fetched(cfg: Config, hub_data: list[tuple[str, str, str | None]]) -> Config:
    for key, path, revision in hub_data:
        hub_snapshot(path, kind="dataset", key=key, revision=revision, local="file or folder")
    if not is_hub_id(cfg.model.pretrained):
        return cfg
    folder = resolve_model_source(cfg.model.pretrained)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrained=str(folder)))
