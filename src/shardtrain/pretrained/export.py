"""`st.save_pretrained`: a sharded model as a Hugging Face folder, streamed one unit at a time.

The files and their headers are planned from the units' layouts first (file_split.py); then every
rank gathers one unit at a time and rank 0 writes and frees its tensors, so no rank holds more than
one unit whole. A peft model exports its adapters in peft's format or, with `merge_lora`, merged into
a plain model (merge.py). `install_save_pretrained` stands in for transformers' own method, which fails
on DTensor shards (docs/pretrained.md, "Export").
"""

from __future__ import annotations

import copy
import json
import os
import types
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.collective import Comm, FirstError
from ..checkpoint.tensorfile import SafetensorsWriter, TensorSpec, writing
from ..checkpoint.this_rank import persistent_buffers
from ..core.held import held_params
from ..core.shard_module import runtime_of
from ..ops.state_dict import gather_params
from .file_split import FilePlan, index_of, parse_size, split_files, stale_files
from .files import CONFIG_FILE, INDEX_FILE
from .keys import adapter_params, base_name, hf_model
from .merge import LoraMerge, lora_merges
from .qlora import QuantizedWeight, quantized_weights

ADAPTER_WEIGHTS = "adapter_model.safetensors"
_ARRIVAL_TIMEOUT_S = 300.0


@dataclass(frozen=True, kw_only=True)
class _Item:
    """One tensor to write: parameter `index` of unit `unit` (merged with `merge`), or buffer `buffer`."""

    spec: TensorSpec
    unit: int | None = None
    index: int | None = None
    buffer: str | None = None
    merge: tuple[LoraMerge, int, int] | None = None  # with the unit indices of A and B
    quantized: tuple[QuantizedWeight, tuple[int, ...]] | None = None  # an NF4 weight: its components' indices


@dataclass(frozen=True, kw_only=True)
class ExportPlan:
    adapter: bool  # peft format (adapter weights only), else a plain model folder
    items: tuple[_Item, ...]
    files: tuple[FilePlan, ...]

    def units(self) -> set[int]:
        return {item.unit for item in self.items if item.unit is not None}


def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    merge_lora: bool = False,
) -> Path:
    """Write sharded `model` (a transformers model, or a peft model around one) to `directory`.

    `dtype`: floating tensors are written in it (None: each in its stored dtype, e.g. the fp32
    masters, so the export is exact). `merge_lora`: a peft model is written as the plain model with
    its adapters merged; otherwise a peft model writes its adapters in peft's format. Every rank of
    the model's process group must call it (each waits at most 5 minutes for the others); rank 0
    writes. Returns `directory`.
    """
    runtime = runtime_of(model)
    comm = Comm.over(runtime.control_group)
    out = Path(directory)
    _wait_for_every_rank(runtime.control_group, comm.world)
    plan = comm.everyone(
        lambda: plan_export(model, dtype=dtype, merge_lora=merge_lora, max_bytes=parse_size(max_shard_size))
    )
    comm.on_rank0(lambda: _make_directory(out))
    writer = _Rank0Writer(out, plan) if comm.rank == 0 else None
    for unit in runtime.units:
        if unit.index not in plan.units():
            continue
        whole = gather_params(unit)
        if writer is not None:
            for item in (i for i in plan.items if i.unit == unit.index):
                writer.write(item, _value(item, whole))
        del whole
    buffers = persistent_buffers(model)

    def finish() -> None:
        for item in (i for i in plan.items if i.buffer is not None):
            writer.write(item, buffers[item.buffer])
        writer.finish(model)

    comm.on_rank0(finish)
    return out


def plan_export(model: nn.Module, *, dtype: torch.dtype | None, merge_lora: bool, max_bytes: int) -> ExportPlan:
    """Every tensor to write, its name, dtype and file; ValueError for a model that cannot be exported."""
    hf = hf_model(model)
    if hf is None:
        raise ValueError(
            f"{type(model).__name__} is not a transformers model: a Hugging Face folder needs its "
            "config; save it with st.save_checkpoint(..., format='full') instead"
        )
    if hf is not model and not hasattr(model, "peft_config"):
        raise ValueError(
            f"{type(model).__name__} holds a transformers model ({type(hf).__name__}) inside it; its "
            "names would not be the ones from_pretrained expects: shard and export that model itself"
        )
    adapters = adapter_params(model)
    if merge_lora and not adapters:
        raise ValueError("merge_lora=True, but the model has no LoRA adapters to merge; export without merging")
    as_adapter = bool(adapters) and not merge_lora
    adapter_name = _adapter_name(model) if as_adapter else None
    merges = {m.weight: m for m in lora_merges(model)} if merge_lora else {}
    held = list(held_params(model))
    where = {h.name: (h.unit.index, h.index) for h in held}
    # an NF4 weight (qlora.py) is written dequantised, under its weight's name, in place of its first component
    quantized = {q.components[0]: q for q in quantized_weights(model)}
    skipped = {c for q in quantized.values() for c in q.components[1:]}
    items = []
    for h in held:
        if (h.name in adapters) != as_adapter or h.name in skipped:
            continue
        q = quantized.get(h.name)
        weight = q.name if q is not None else h.name
        name = h.name.replace(f".{adapter_name}", "") if as_adapter else base_name(weight)
        merge = None
        if weight in merges:
            m = merges[weight]
            (ua, ia), (ub, ib) = where[m.lora_a], where[m.lora_b]
            if ua != h.unit.index or ub != h.unit.index:
                raise ValueError(
                    f"{m.lora_a} is not in the sharding unit of {h.name}; merging needs an adapter "
                    "in its layer's unit: do not make the adapter modules units of their own"
                )
            merge = (m, ia, ib)
        items.append(
            _Item(
                spec=TensorSpec(
                    name=name,
                    dtype=_dtype(q.dtype if q else h.layout.dtype, dtype),
                    shape=q.shape if q else h.shape,
                ),
                unit=h.unit.index,
                index=h.index,
                merge=merge,
                quantized=(q, tuple(where[c][1] for c in q.components)) if q else None,
            )
        )
    if not as_adapter:
        items += [
            _Item(spec=TensorSpec(name=base_name(n), dtype=_dtype(b.dtype, dtype), shape=tuple(b.shape)), buffer=n)
            for n, b in persistent_buffers(model).items()
        ]
    names = [item.spec.name for item in items]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"tensors {twice[:3]} would be written twice; the model holds a name both with and "
            "without peft's prefix: export the base model or the peft model, not a mix"
        )
    specs = [item.spec for item in items]
    if as_adapter:
        files = [FilePlan(name=ADAPTER_WEIGHTS, specs=tuple(specs))]
    else:
        files = split_files(specs, max_bytes=max_bytes)
    return ExportPlan(adapter=as_adapter, items=tuple(items), files=tuple(files))


def _dtype(stored: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    return wanted if wanted is not None and stored.is_floating_point else stored


def _adapter_name(model: nn.Module) -> str:
    configs = getattr(model, "peft_config", {})
    if len(configs) != 1:
        raise ValueError(f"the model holds {len(configs)} peft adapters {sorted(configs)}; export one at a time")
    return next(iter(configs))


def _value(item: _Item, whole: list[torch.Tensor]) -> torch.Tensor:
    tensor = whole[item.index]
    if item.quantized is not None:
        q, indices = item.quantized
        tensor = q.dequantize([whole[i] for i in indices])
    if item.merge is not None:
        merge, a, b = item.merge
        return merge.merged(tensor, whole[a], whole[b], dtype=item.spec.dtype)
    return tensor.to(item.spec.dtype)


def _wait_for_every_rank(group: dist.ProcessGroup | None, world: int) -> None:
    """Fail, naming the absent ranks, rather than hang when only some ranks export (e.g. `if rank == 0`)."""
    if world == 1:
        return
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=_ARRIVAL_TIMEOUT_S), wait_all_ranks=True)
    except RuntimeError as exc:
        raise RuntimeError(
            f"save_pretrained of a sharded model gathers it from every rank, and not every rank "
            f"called it ({exc}); call it on all ranks (rank 0 writes)"
        ) from None


class _Rank0Writer:
    """Rank 0's files. Each file is written in its planned order, opened at its first tensor and closed
    at its last (a tensor larger than `max_shard_size` has a file of its own while the current one is
    still open, as in transformers' split). An I/O error stops the writing but not the loop over units
    (docs/design.md, Note [Errors inside a loop of collectives]): `finish` raises it."""

    def __init__(self, directory: Path, plan: ExportPlan) -> None:
        self.directory = directory
        self.plan = plan
        self._failed = FirstError()
        self._file_of = {spec.name: k for k, f in enumerate(plan.files) for spec in f.specs}
        self._left = [len(f.specs) for f in plan.files]
        self._open: dict[int, SafetensorsWriter] = {}

    def _partial(self, name: str) -> Path:
        return self.directory / f".{name}.partial"

    def _writer(self, k: int) -> SafetensorsWriter:
        if k not in self._open:
            plan = self.plan.files[k]
            self._open[k] = SafetensorsWriter(self._partial(plan.name), plan.specs)
        return self._open[k]

    def write(self, item: _Item, tensor: torch.Tensor) -> None:
        self._failed.run(lambda: self._write(item, tensor))

    def _write(self, item: _Item, tensor: torch.Tensor) -> None:
        k = self._file_of[item.spec.name]
        self._writer(k).write(item.spec.name, tensor)
        self._left[k] -= 1
        if self._left[k] == 0:
            self._open.pop(k).close()

    def finish(self, model: nn.Module) -> None:
        self._failed.check()
        for k, left in enumerate(self._left):
            if left == 0 and not self.plan.files[k].specs:  # a file planned empty (a model without tensors)
                self._writer(k)
                self._open.pop(k).close()
        with writing(self.directory):
            for path in stale_files(self.directory, list(self.plan.files)):
                path.unlink()
            for plan in self.plan.files:
                os.replace(self._partial(plan.name), self.directory / plan.name)
        if len(self.plan.files) > 1:
            _write_json(self.directory / INDEX_FILE, index_of(list(self.plan.files)))
        _write_config(model, self.directory, self.plan)


def _make_directory(directory: Path) -> None:
    with writing(directory):
        directory.mkdir(parents=True, exist_ok=True)


def _write_json(path: Path, value: Any) -> None:
    with writing(path):
        path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def _write_config(model: nn.Module, directory: Path, plan: ExportPlan) -> None:
    """config.json (the dtype most of the weights were written in; no `quantization_config`, which a
    model loaded from a bitsandbytes folder keeps: what is written is never quantised, and from_pretrained
    would quantise it again) and generation_config.json; for an adapter export, peft's adapter_config.json."""
    with writing(directory / CONFIG_FILE):
        if plan.adapter:
            config = copy.deepcopy(model.peft_config[_adapter_name(model)])
            config.inference_mode = True
            config.save_pretrained(str(directory))
            return
        hf = hf_model(model)
        config = copy.deepcopy(hf.config)
        config.architectures = [type(hf).__name__]
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        sizes: dict[torch.dtype, int] = {}
        for spec in (s for f in plan.files for s in f.specs if s.dtype.is_floating_point):
            sizes[spec.dtype] = sizes.get(spec.dtype, 0) + spec.nbytes
        if sizes:
            config.dtype = str(max(sizes, key=sizes.get)).removeprefix("torch.")
        config.save_pretrained(str(directory))
        generation = getattr(hf, "generation_config", None)
        if generation is not None and hf.can_generate():
            generation.save_pretrained(str(directory))


_ACCEPTED = {"max_shard_size", "is_main_process", "safe_serialization"}


def install_save_pretrained(model: nn.Module) -> None:
    """Give sharded `model` (if it has a `save_pretrained`) one that writes full tensors (`save_pretrained`
    above): every rank calls it, rank 0 writes."""
    if callable(getattr(model, "save_pretrained", None)):
        model.save_pretrained = types.MethodType(_sharded_save_pretrained, model)


def _sharded_save_pretrained(self: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> Path:
    """transformers' / peft's `save_pretrained(save_directory, max_shard_size=...)` for a sharded model."""
    if kwargs.get("safe_serialization", True) is not True:
        raise ValueError("save_pretrained(safe_serialization=False): a sharded model is saved as safetensors only")
    refused = sorted(k for k, v in kwargs.items() if k not in _ACCEPTED and v not in (None, False))
    if refused:
        raise ValueError(
            f"save_pretrained({', '.join(f'{k}=...' for k in refused)}) is not supported on a sharded "
            "model; it writes full tensors with shardtrain.save_pretrained(model, directory, "
            "max_shard_size=..., dtype=..., merge_lora=...)"
        )
    return save_pretrained(self, save_directory, max_shard_size=kwargs.get("max_shard_size", "5GB"))
