"""Weights files already quantised by bitsandbytes (transformers' `load_in_4bit` / `load_in_8bit`
folders, such as the Hub's `*-bnb-4bit` checkpoints), read as the 16- or 32-bit weights they encode.

transformers' `save_pretrained` writes a 4-bit weight `W` (of n values) as several tensors:

    W                  uint8 [ceil(n/2), 1]: the values' 4-bit codes, row-major, two a byte, high nibble first
    W.absmax           the scale of each block of `blocksize` values: float32, or uint8 when double-quantised
    W.quant_map        float32 [16]: the levels the codes index (NF4 or FP4)
    W.nested_absmax    float32, one per `nested_blocksize` scales     } double quantisation
    W.nested_quant_map float32 [256]: the scales' 8-bit code          } only
    W.quant_state.bitsandbytes__nf4 (or __fp4): uint8, the JSON of quant_type, blocksize, dtype, shape, nested_*

and an 8-bit (LLM.int8) layer `M` as `M.weight` int8 [out, in], `M.SCB` float32 [out] (each row's
absolute maximum) and `M.weight_format` (0: row-major). `group` presents each such group as one
`TensorEntry` of the weight's true shape and dtype, so key matching and shape checks see an ordinary
tensor and the companion keys are neither matched nor unexpected; `dequantize` computes the weight with
bitsandbytes' arithmetic, written in plain torch (bitsandbytes is not needed to read them):
`quant_map[code] * absmax[block]`, a double-quantised scale being
`nested_quant_map[absmax] * nested_absmax[group] + nested_offset`, and `int8 * SCB / 127`.
Anything else that looks quantised is refused naming the key and the fix (the 16-bit folder).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

if TYPE_CHECKING:
    from .files import TensorEntry

QUANT_STATE = ".quant_state.bitsandbytes__"
_NESTED = ("nested_absmax", "nested_quant_map")
_COMPANIONS = frozenset({"absmax", "quant_map", *_NESTED, "SCB", "weight_format"})
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_FIX = "load the model's 16-bit (unquantised) folder instead"
_READ = "shardtrain reads bitsandbytes' 4-bit (nf4, fp4; uint8 storage) and 8-bit layouts as transformers saves them"


@dataclass(frozen=True, kw_only=True)
class Packed:
    """How bitsandbytes stores one weight: the layout, the file's tensors by role ("weight", "absmax",
    "SCB", ...) and, for 4 bits, the quant state's numbers."""

    quant_type: str  # "nf4", "fp4" or "int8"
    parts: tuple[tuple[str, TensorEntry], ...]
    blocksize: int = 0
    nested_blocksize: int = 0  # 0: the scales are stored in float32 (no double quantisation)
    nested_offset: float = 0.0


def group(tensors: dict[str, TensorEntry], *, folder: Path) -> dict[str, TensorEntry]:
    """`tensors` with each bitsandbytes group replaced by one entry of the weight's true shape and
    dtype (its `packed` says how to read it); ValueError, naming the key and the fix, for a layout
    that is not read (module docstring) or a `quantization_config` of another method in `folder`."""
    _check_method(folder / "config.json")
    states = {k: e for k, e in tensors.items() if QUANT_STATE in k}
    formats = {k: e for k, e in tensors.items() if k.endswith(".weight_format")}
    small = _read_small([*states.values(), *formats.values()])
    out = dict(tensors)
    found = [_four_bit(k, tensors, small[k]) for k in states]
    found += [_eight_bit(k, tensors, small) for k in tensors if k.endswith(".SCB")]
    for entry in found:
        for _, part in entry.packed.parts if entry.packed else ():
            out.pop(part.key, None)
        out[entry.key] = entry
    for key, entry in out.items():
        last = key.rpartition(".")[2]
        if entry.packed is None and (last in _COMPANIONS or ".quant_state." in key):
            raise ValueError(
                f"{entry.file}: tensor {key!r} is part of a bitsandbytes layout whose weight or quant_state "
                f"is missing or not recognised; {_READ}: {_FIX}"
            )
        if entry.packed is None and entry.dtype == torch.int8 and last == "weight":
            raise ValueError(
                f"{entry.file}: tensor {key!r} is int8 without the {key.removesuffix('weight')}SCB scales of "
                f"bitsandbytes' 8-bit layout; {_READ}: {_FIX}"
            )
    return out


def dequantize(
    entry: TensorEntry, read: Callable[[TensorEntry, int, int], torch.Tensor], *, rows: tuple[int, int] | None = None
) -> torch.Tensor:
    """Rows `rows` (default: all) of the weight `entry` (a `group` entry) encodes, in its dtype.
    `read(part, start, stop)` gives a file tensor's elements [start, stop) along dim 0: only the blocks
    holding those rows are read (and, double-quantised, the groups of scales holding their scales)."""
    packed = entry.packed
    assert packed is not None, entry.key
    first, stop = rows or (0, entry.shape[0])
    part = dict(packed.parts)
    if packed.quant_type == "int8":  # bitsandbytes' int8_vectorwise_dequant: in float32
        return read(part["weight"], first, stop) * read(part["SCB"], first, stop).view(-1, 1) * (1 / 127)
    width, size, block = math.prod(entry.shape[1:]), math.prod(entry.shape), packed.blocksize
    wanted = (first * width, stop * width)  # the values asked for, in the flattened weight
    blocks = (wanted[0] // block, -(-wanted[1] // block))  # the blocks holding them
    absmax = read(part["absmax"], *blocks)
    if packed.nested_blocksize:
        group = packed.nested_blocksize
        factors = read(part["nested_absmax"], blocks[0] // group, -(-blocks[1] // group))
        scales = read(part["nested_quant_map"], 0, 256)[absmax.int()]
        absmax = scales * factors[torch.arange(*blocks) // group - blocks[0] // group]
        absmax = absmax + torch.tensor(packed.nested_offset, dtype=torch.float32)
    start, end = blocks[0] * block, min(blocks[1] * block, size)  # blocks are of an even size: whole bytes
    table = read(part["quant_map"], 0, 16)
    codes = torch.arange(256)
    pairs = torch.stack((table[codes >> 4], table[codes & 15]), dim=-1).view(torch.int64).flatten()
    data = read(part["weight"], start // 2, -(-end // 2)).flatten().int()
    values = torch.index_select(pairs, 0, data).view(torch.float32)[: end - start]  # both nibbles in one gather
    out = _blockwise(values, absmax, block)[wanted[0] - start : wanted[1] - start]
    return out.view(stop - first, *entry.shape[1:]).to(entry.dtype)


def _blockwise(values: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """`values[i] * scales[i // block]` in float32, a last partial block included."""
    n = values.numel()
    if n % block:
        values = torch.nn.functional.pad(values, (0, block - n % block))
    return (values.view(-1, block) * scales.view(-1, 1)).flatten()[:n]


def _four_bit(state_key: str, tensors: dict[str, TensorEntry], raw: torch.Tensor) -> TensorEntry:
    """The entry of a 4-bit weight, from its quant_state key and its companions, checked."""
    key, _, quant_type = state_key.partition(QUANT_STATE)
    file = tensors[state_key].file

    def refuse(what: str) -> ValueError:
        return ValueError(f"{file}: bitsandbytes weight {key!r} {what}; {_READ}: {_FIX}")

    if quant_type not in ("nf4", "fp4"):
        raise refuse(f"has quant_type {quant_type!r}")
    try:
        state = json.loads(bytes(raw.tolist()).decode("utf-8"))
        shape, dtype, blocksize = tuple(int(s) for s in state["shape"]), _DTYPES[state["dtype"]], state["blocksize"]
        nested = "nested_blocksize" in state
        nested_blocksize, offset = (
            (int(state["nested_blocksize"]), float(state["nested_offset"])) if nested else (0, 0.0)
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise refuse(f"has a quant_state this version does not read ({type(exc).__name__}: {exc})") from None
    if type(blocksize) is not int or blocksize <= 0 or blocksize % 2 or (nested and nested_blocksize <= 0):
        raise refuse(f"has blocksize {blocksize!r} (nested: {nested_blocksize}); bitsandbytes' are powers of 2")
    roles = ("weight", "absmax", "quant_map", *(_NESTED if nested else ()))
    names = {role: key if role == "weight" else f"{key}.{role}" for role in roles}
    absent = [name for name in names.values() if name not in tensors]
    if absent:
        raise refuse(f"lacks {absent[0]!r}")
    parts = {role: tensors[name] for role, name in names.items()}
    n_scales = -(-math.prod(shape) // blocksize)
    expected = {
        "weight": (torch.uint8, (-(-math.prod(shape) // 2), 1)),
        "absmax": (torch.uint8 if nested else torch.float32, (n_scales,)),
        "quant_map": (torch.float32, (16,)),
        "nested_absmax": (torch.float32, (-(-n_scales // max(nested_blocksize, 1)),)),
        "nested_quant_map": (torch.float32, (256,)),
    }
    for role, part in parts.items():
        if (part.dtype, part.shape) != expected[role]:
            stored = "is stored" if role == "weight" else f"has {part.key!r}"
            storage = role == "weight" and part.dtype != torch.uint8
            raise refuse(
                f"{stored} as {part.dtype} {list(part.shape)} where its quant_state ({quant_type}, shape {list(shape)}, "
                f"blocksize {blocksize}) implies {expected[role][0]} {list(expected[role][1])}"
                + (" (a bnb_4bit_quant_storage other than uint8)" if storage else "")
            )
    if state.get("quant_type") != quant_type or state.get("nested_dtype", "float32") != "float32":
        raise refuse(
            f"has a quant_state that disagrees with its key or stores its scales' code in another dtype: {state}"
        )
    packed = Packed(
        quant_type=quant_type,
        parts=(*parts.items(), ("quant_state", tensors[state_key])),
        blocksize=blocksize,
        nested_blocksize=nested_blocksize,
        nested_offset=offset,
    )
    return dataclasses.replace(parts["weight"], shape=shape, dtype=dtype, packed=packed)


def _eight_bit(scb_key: str, tensors: dict[str, TensorEntry], small: dict[str, torch.Tensor]) -> TensorEntry:
    """The entry of an 8-bit (LLM.int8) weight, from its SCB key, its weight and its weight_format, checked."""
    module = scb_key.removesuffix(".SCB")
    key, scb = f"{module}.weight", tensors[scb_key]
    weight = tensors.get(key)
    fmt = small.get(f"{key}_format")
    if weight is None or weight.dtype != torch.int8 or len(weight.shape) != 2:
        what = "is missing" if weight is None else f"is {weight.dtype} {list(weight.shape)}, not int8 [out, in]"
    elif scb.dtype != torch.float32 or scb.shape != weight.shape[:1]:
        what = f"has scales {scb_key!r} of {scb.dtype} {list(scb.shape)}, not float32 [{weight.shape[0]}]"
    elif fmt is not None and (fmt.dim() or int(fmt) != 0):
        what = f"is stored in weight_format {fmt.tolist()} (a tiled GPU layout), not 0 (row-major)"
    else:
        parts = [("weight", weight), ("SCB", scb)] + (
            [("weight_format", tensors[f"{key}_format"])] if fmt is not None else []
        )
        return dataclasses.replace(weight, dtype=torch.float32, packed=Packed(quant_type="int8", parts=tuple(parts)))
    raise ValueError(f"{scb.file}: bitsandbytes 8-bit weight {key!r} {what}; {_READ}: {_FIX}")


def _read_small(entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """The values of a few small tensors (quant states, formats), each file opened once."""
    out: dict[str, torch.Tensor] = {}
    for file in dict.fromkeys(e.file for e in entries):
        try:
            with safe_open(str(file), framework="pt") as handle:
                out.update({e.key: handle.get_tensor(e.key) for e in entries if e.file == file})
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{file} is not a readable safetensors file ({exc}); copy it again") from None
    return out


def _check_method(config: Path) -> None:
    """ValueError when `config` names a quantization method other than bitsandbytes (GPTQ, AWQ, FP8...)."""
    try:
        method = (json.loads(config.read_text(encoding="utf-8")).get("quantization_config") or {}).get("quant_method")
    except (OSError, ValueError, AttributeError):
        return  # no readable config: the model's builder says so
    if method not in (None, "bitsandbytes"):
        raise ValueError(
            f"{config}: quantization_config.quant_method={method!r}; shardtrain reads 16- or 32-bit weights and "
            f"bitsandbytes' 4- and 8-bit layouts, not {method}'s: {_FIX}"
        )
