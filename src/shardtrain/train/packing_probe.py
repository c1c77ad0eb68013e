"""Whether a model keeps packed documents apart, decided by running it (train/packed.py asks).

A model's source cannot say it: transformers models that take `position_ids` may still build their
masks without them (OPT) and attend across documents. So no-grad forwards of two packed rows decide:
each packed document's logits must equal the document's logits alone, and the second documents'
logits must not move when the first documents change, both within a number of ulps of the least
precise dtype the model computes in. It runs on the real model as it will train (sharded, every rank
together; wrapped by peft; in its compute dtype): docs/design.md, Note [Packing probe].
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "MATCH_ULPS",
    "PROBE_LENGTHS",
    "PROBE_SHAPE",
    "SEPARATION_ULPS",
    "PackingProbe",
    "probe_packing",
    "probe_positions",
]

# Each row's document lengths: the boundaries differ between the rows, a long first document moves a
# second one attending to it visibly, and every length is a multiple of 8, so that sequence
# parallelism (the sequence split over up to 8 tp ranks) splits each forward evenly.
PROBE_LENGTHS = ((24, 8), (8, 24))
PROBE_SHAPE = (len(PROBE_LENGTHS), sum(PROBE_LENGTHS[0]))  # every forward of the probe: (rows, tokens)
SEPARATION_ULPS = 8
MATCH_ULPS = 64
_REDUCED_FLOAT32 = {"high": 2.0**-10, "medium": 2.0**-7}  # tf32's and bf16's ulp at 1

Forward = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class PackingProbe:
    """What the probe measured of one model, and its verdict."""

    model: str  # the model's class name
    dtype: torch.dtype  # the least precise dtype its layers computed in
    ulp: float  # that dtype's ulp at 1 (float32 at reduced matmul precision: tf32's or bf16's)
    vs_alone: float  # worst |logit difference| of a packed document against the document alone
    crosstalk: float  # worst |logit difference| of the second documents when the first ones change
    scale: float  # largest |logit| of the documents alone

    @property
    def separation_tolerance(self) -> float:
        return SEPARATION_ULPS * self.ulp * self.scale

    @property
    def match_tolerance(self) -> float:
        return MATCH_ULPS * self.ulp * self.scale

    @property
    def keeps_documents_apart(self) -> bool:
        """True when both differences are within their tolerances (all-zero logits show nothing: False)."""
        return self.scale > 0 and self.crosstalk <= self.separation_tolerance and self.vs_alone <= self.match_tolerance

    def refusal(self) -> str:
        """The one line that refuses packing for this model."""
        if self.scale == 0:
            return (
                f"{self.model} gave all-zero logits to the packing probe, so nothing shows whether it keeps packed "
                "documents apart; train unpacked: --data.packing false"
            )
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.model} lets packed documents attend to each other: a document's logits packed differ from "
            f"the document alone by up to {self.vs_alone:.3g} (allowed {self.match_tolerance:.2g}) and move by "
            f"up to {self.crosstalk:.3g} when another document of its row changes (allowed "
            f"{self.separation_tolerance:.2g}; {dtype}, largest logit {self.scale:.3g}); train unpacked: "
            "--data.packing false"
        )


def probe_packing(
    model: nn.Module, forward: Forward, *, name: str, vocab_size: int, device: torch.device
) -> PackingProbe:
    """Run the probe (module docstring) on `model` through `forward(input_ids, position_ids)`; token ids
    are drawn below `vocab_size`, the inputs put on `device`.

    Every forward has the shape PROBE_SHAPE and packed position_ids, so a compiled attention that
    specialises on shapes and masks (transformers' flex_attention) compiles once for the probe. A
    document's logits alone are its logits as the first document of a row: under causal attention
    nothing after it reaches it, whether or not the model honours the document boundaries, and its
    positions start at 0 as alone. The rows rotated so that each document comes first give them."""
    generator = torch.Generator().manual_seed(0)
    docs = [[torch.randint(0, vocab_size, (n,), generator=generator) for n in row] for row in PROBE_LENGTHS]
    # every token of each row's first document replaced by another
    shift = [torch.randint(1, max(vocab_size, 2), (row[0],), generator=generator) for row in PROBE_LENGTHS]
    changed = [[(row[0] + s) % vocab_size, *row[1:]] for row, s in zip(docs, shift)]
    rotations = [[row[k:] + row[:k] for row in docs] for k in range(1, len(docs[0]))]

    def rows(documents: list[list[torch.Tensor]]) -> torch.Tensor:
        return torch.stack([torch.cat(row) for row in documents]).to(device)

    def positions(documents: list[list[torch.Tensor]]) -> torch.Tensor:
        return probe_positions([[len(doc) for doc in row] for row in documents], device=device)

    with _eval_mode(model), torch.no_grad(), _computed_dtypes(model) as dtypes:
        packed = _full(forward(rows(docs), positions(docs)))
        moved = _full(forward(rows(changed), positions(changed)))
        firsts = [packed, *(_full(forward(rows(r), positions(r))) for r in rotations)]
        alone = [[firsts[k][r, : len(doc)] for k, doc in enumerate(row)] for r, row in enumerate(docs)]
    vs_alone = crosstalk = scale = 0.0
    for r, row in enumerate(docs):
        start = 0
        for d, doc in enumerate(row):
            span = slice(start, start + len(doc))
            vs_alone = max(vs_alone, _worst(packed[r, span], alone[r][d]))
            scale = max(scale, alone[r][d].abs().max().item())
            if d > 0:
                crosstalk = max(crosstalk, _worst(packed[r, span], moved[r, span]))
            start += len(doc)
    dtype = max(dtypes or {packed.dtype}, key=lambda t: torch.finfo(t).eps)
    return PackingProbe(model=name, dtype=dtype, ulp=_ulp(dtype), vs_alone=vs_alone, crosstalk=crosstalk, scale=scale)


def probe_positions(lengths=PROBE_LENGTHS, *, device: torch.device) -> torch.Tensor:
    """The position_ids of rows packed with documents of `lengths` (each row's lengths; each starts at 0)."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(device)


def _full(logits: torch.Tensor) -> torch.Tensor:
    """Logits whole and in float32 (a DTensor split over the tp ranks is gathered: every rank probes)."""
    return (logits.full_tensor() if isinstance(logits, DTensor) else logits).float()


def _worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _ulp(dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return _REDUCED_FLOAT32.get(torch.get_float32_matmul_precision(), torch.finfo(dtype).eps)
    return torch.finfo(dtype).eps


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode (no dropout) inside; each module's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def _computed_dtypes(model: nn.Module) -> Iterator[set[torch.dtype]]:
    """The floating dtypes of the outputs of the modules that hold parameters, collected inside."""
    seen: set[torch.dtype] = set()

    def record(_module: nn.Module, _inputs: object, output: object) -> None:
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            seen.add(output.dtype)

    handles = [
        m.register_forward_hook(record) for m in model.modules() if next(m.parameters(recurse=False), None) is not None
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
