"""`RunSpec`: everything one measured run needs, passed from the runner to the worker processes.

The runner turns a spec into command-line arguments for `python -m shardtrain.bench.worker`, and the
worker parses them back, so both sides agree on one definition instead of two argument lists.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields

from ..models.llama import LlamaConfig
from .sizes import parse_size

PRECISIONS = ("bf16", "fp32")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One engine training one model configuration for `warmup + steps` steps (plus profiled steps)."""

    engine: str
    size: str
    batch: int
    seq: int
    ac: bool
    steps: int
    warmup: int
    device: str
    precision: str
    seed: int = 0
    compile: bool = False  # each Block's forward through torch.compile (`Block.compile()`), every engine alike
    float8: bool = False  # torchao float8 Linears (`ops.float8`'s choice) in every engine's model; needs compile
    shard_world: int = 1  # the N of "1/N of the optimizer" in the ideal step; the world size elsewhere
    profile_steps: int = 0  # steps traced by torch.profiler after the timed ones (0: none)
    trace_path: str = ""  # where rank 0 writes the gzipped profiler trace ("" : do not keep it)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r}: use one of {list(DEVICES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: use one of {list(PRECISIONS)}")
        for name in ("batch", "seq", "steps", "shard_world"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("warmup", "profile_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must not be negative")
        if self.float8 and not self.compile:
            raise ValueError("float8=True needs compile=True: eager float8 casts are slower than bf16")
        self.model_config()  # an unknown size fails here, in the runner, not in every rank

    def model_config(self) -> LlamaConfig:
        """The Llama configuration of `size` (a size token: sizes.py), with rotary tables long enough for `seq`."""
        return parse_size(self.size).model_config(seq=self.seq)

    @property
    def tokens_per_rank_step(self) -> int:
        return self.batch * self.seq

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps + self.profile_steps

    def to_argv(self) -> list[str]:
        """Command-line arguments that `parse_spec` turns back into this spec."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            argv += [f"--{f.name.replace('_', '-')}", str(int(value)) if isinstance(value, bool) else str(value)]
        return argv


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare one option per `RunSpec` field (booleans travel as 0/1)."""
    for f in fields(RunSpec):
        kind = {"str": str, "int": int, "bool": int}[f.type]  # the module's annotations are strings
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, required=f.default is MISSING)


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    values = {f.name: getattr(args, f.name) for f in fields(RunSpec)}
    values = {k: v for k, v in values.items() if v is not None}
    for f in fields(RunSpec):
        if f.type == "bool" and f.name in values:
            values[f.name] = bool(values[f.name])
    return RunSpec(**values)
