"""`st.load_pretrained`: fill a sharded model from Hugging Face safetensors, each rank its own rows.

Every rank reads the headers of the weights files (files.py), matches names (keys.py) and checks
shapes, so every rank reaches the same verdict before any data is read. Then, unit by unit, each
rank reads exactly the block it holds of every parameter (its rows, `get_slice(key)[start:stop]`;
under tensor parallelism a range of columns too where "tp" splits dim 1: tp/boxes.py) and copies
them into its shard in place, converting dtype on the way (a bf16 file into fp32 masters). Files
are memory-mapped; a unit's handles are closed before the next unit is read, so the file pages a
rank has touched leave its resident memory with them and no rank ever holds a whole file or model.
A 4-bit (NF4) layer (qlora.py) is the exception: its weight is read whole, one layer at a time, and
quantised on the rank's device, which keeps its rows of the packed weight and of the scales. A weight
the file holds quantised by bitsandbytes (bnb_layout.py) is read as the blocks of codes and scales
holding the rank's rows, dequantised on the host (an NF4 layer reads all of it and quantises it again).
Persistent buffers found in the file are loaded whole on every rank; non-persistent buffers (rotary
tables) keep the values the model's own initialisation computed when `st.shard` materialised it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..checkpoint.collective import Comm
from ..checkpoint.format import short_list
from ..checkpoint.this_rank import persistent_buffers
from ..core.held import held_params
from ..core.shard_module import runtime_of
from ..tp.boxes import Box
from .bnb_layout import dequantize
from .export import install_save_pretrained
from .files import TensorEntry, WeightFiles, resolve_weights
from .keys import KeyMatch, match_keys
from .qlora import QuantizedWeight, quantized_weights


@dataclass(frozen=True, kw_only=True)
class LoadReport:
    """What `load_pretrained` did: tensors loaded, and the names that kept their initial values."""

    path: Path
    loaded: int  # parameters and buffers filled from the files
    missing: tuple[str, ...]  # only with strict=False
    unexpected: tuple[str, ...]  # file keys nothing took (only with strict=False)
    adapters: tuple[str, ...]  # peft adapter parameters, initialised by peft

    def describe(self) -> str:
        parts = [f"loaded {self.loaded} tensors from {self.path}"]
        if self.adapters:
            parts.append(f"{len(self.adapters)} adapter parameters keep peft's initialisation")
        if self.missing:
            parts.append(f"missing (initialised, not loaded) {short_list(list(self.missing), 4)}")
        if self.unexpected:
            parts.append(f"ignored file keys {short_list(list(self.unexpected), 4)}")
        return "; ".join(parts)


def load_pretrained(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> LoadReport:
    """Load pretrained weights from `path` into `model` (already passed through `st.shard`), in place.

    `path`: a `.safetensors` file, a folder holding `model.safetensors`, or one holding
    `model.safetensors.index.json` and the files it lists. Names are matched as keys.py says (peft
    prefixes, the base-model prefix, tied weights); values are converted to each parameter's stored
    dtype. With `strict`, a parameter or persistent buffer the files lack, or a file key nothing
    takes, is an error; with `strict=False` they keep their initial values and are reported. A shape
    that disagrees is always an error. Every rank of the model's process group must call it; all
    raise if any fails. The model also gets a `save_pretrained` that writes full tensors (export.py).
    """
    runtime = runtime_of(model)
    comm = Comm.over(runtime.control_group)

    def load() -> LoadReport:
        weights = resolve_weights(path)
        buffers = persistent_buffers(model)
        held = list(held_params(runtime))
        quantized = quantized_weights(model)  # NF4 layers (qlora.py): matched and read as their whole weight
        component = {name: (q, k) for q in quantized for k, name in enumerate(q.components)}
        params = [h.layout for h in held if h.name not in component] + [q.as_shard() for q in quantized]
        match = match_keys(params=params, buffers=buffers, file_keys=weights.tensors, model=model)
        shapes = {h.name: h.shape for h in held} | {q.name: q.shape for q in quantized}
        _check(weights, match, shapes=shapes, buffers=buffers, strict=strict)
        with torch.no_grad():
            for _, of_unit in itertools.groupby(held, key=lambda h: h.unit):
                with _Handles() as handles:  # the files stay open for one unit at a time
                    parts: dict[str, list[torch.Tensor]] = {}  # one layer's components, whole, while its unit loads
                    for h in of_unit:
                        key = match.params.get(component[h.name][0].name if h.name in component else h.name)
                        local = h.local
                        if key is None or local.numel() == 0:
                            continue
                        if h.name in component:
                            q, k = component[h.name]
                            whole = _quantized(parts, q, handles, weights.tensors[key], local.device)[k]
                            local.copy_(whole[h.rows[0] : h.rows[1]] if whole.dim() else whole)
                            continue
                        rows = _read_box(handles, weights.tensors[key], h.box).view(local.shape)
                        # Note: the rows cross to the device in the file's dtype and are converted there
                        # (copy_ would convert on the host first: twice the bytes over the bus for bf16
                        # -> fp32, and a host temporary). An in-place copy bumps the shard's version, so
                        # a resident unsharded copy (no_shard, optimizer_only) is gathered again.
                        local.copy_(rows.to(local.device) if rows.device != local.device else rows)
            with _Handles() as handles:
                for name, key in match.buffers.items():
                    value = handles.open(weights.tensors[key].file).get_tensor(key)
                    buffers[name].copy_(value.to(buffers[name].device))
        return LoadReport(
            path=weights.path,
            loaded=len(match.params) + len(match.buffers),
            missing=match.missing,
            unexpected=match.unexpected,
            adapters=match.adapters,
        )

    report = comm.everyone(load)
    install_save_pretrained(model)
    return report


def _check(
    weights: WeightFiles,
    match: KeyMatch,
    *,
    shapes: dict[str, tuple[int, ...]],
    buffers: dict[str, torch.Tensor],
    strict: bool,
) -> None:
    """Shapes (the parameters' global ones) always; missing and unexpected keys with `strict`. One line
    naming the file and the key."""
    for name, key in [*match.params.items(), *match.buffers.items()]:
        entry = weights.tensors[key]
        expected = shapes[name] if name in shapes else tuple(buffers[name].shape)
        if entry.shape != expected:
            raise ValueError(
                f"{entry.file}: tensor {key!r} has shape {entry.shape}, the model's {name!r} has "
                f"{expected}; the weights belong to another configuration: build the model from the "
                "config.json saved with them"
            )
    if not strict:
        return
    if match.missing:
        raise ValueError(
            f"{weights.path}: no tensor for the model's {match.missing[0]!r} ({len(match.missing)} "
            f"missing: {short_list(list(match.missing), 4)}); load weights of this model, or pass "
            "strict=False to keep the initial values of what is missing"
        )
    if match.unexpected:
        key = match.unexpected[0]
        raise ValueError(
            f"{weights.tensors[key].file}: tensor {key!r} matches no parameter or buffer of the model "
            f"({len(match.unexpected)} unexpected: {short_list(list(match.unexpected), 4)}); load "
            "weights of this model, or pass strict=False to ignore them"
        )


def _quantized(
    parts: dict[str, list[torch.Tensor]], q: QuantizedWeight, handles: _Handles, entry: TensorEntry, device
) -> list[torch.Tensor]:
    """The components of `q`'s weight, quantised on `device` once per unit from the whole weight in the file."""
    if q.name not in parts:
        whole = _read_box(handles, entry, Box(rows=(0, q.shape[0]), cols=None))
        parts[q.name] = q.quantize(whole.to(device))
    return parts[q.name]


def _read_box(handles: _Handles, entry: TensorEntry, box: Box) -> torch.Tensor:
    """The block `box` of `entry` (its rows, and under tensor parallelism perhaps a range of its
    columns; the whole tensor when it is 0-dim), read from its file; of a bitsandbytes-quantised weight,
    the blocks holding those rows, dequantised (then cut to the columns)."""
    (first, stop), cols = box.rows, box.cols
    try:
        if entry.packed is not None:
            rows = dequantize(entry, lambda part, a, b: handles.open(part.file).get_slice(part.key)[a:b], rows=box.rows)
            return rows if cols is None else rows[:, cols[0] : cols[1]].contiguous()
        handle = handles.open(entry.file)
        if not entry.shape:
            return handle.get_tensor(entry.key)
        piece = handle.get_slice(entry.key)
        return piece[first:stop] if cols is None else piece[first:stop, cols[0] : cols[1]]
    except SafetensorError as exc:
        raise ValueError(
            f"{entry.file}: cannot read tensor {entry.key!r} ({exc}); the file is damaged: copy it again"
        ) from None


class _Handles(contextlib.AbstractContextManager):
    """Safetensors handles opened on first use and all closed (unmapped) on exit."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._open: dict[Path, object] = {}

    def open(self, file: Path):
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(str(file), framework="pt"))
        return self._open[file]

    def __exit__(self, *exc) -> None:
        self._stack.close()
