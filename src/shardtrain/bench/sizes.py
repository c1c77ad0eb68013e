"""The model sizes `shardtrain bench --sizes` takes: a built-in Llama size, optionally with settings of its
own after colons, so that rows of differently shaped runs come from one invocation.

    1.5b                       the built-in 1.5B, with the invocation's --batch and --ac
    8b:layers=8:batch=1:ac     the first 8 layers of the 8B shape, batch 1, every block checkpointed

The whole token names the size in the rows, the JSON and the trace files.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.llama import LlamaConfig, llama_config

_SYNTAX = "use NAME[:layers=N][:batch=N][:ac], e.g. 8b:layers=8:batch=1:ac"


@dataclass(frozen=True, kw_only=True)
class BenchSize:
    """A parsed size token: the built-in size, and what it sets instead of the invocation's options."""

    name: str
    layers: int | None = None
    batch: int | None = None
    ac: bool = False

    def model_config(self, *, seq: int | None = None) -> LlamaConfig:
        """The Llama configuration (rotary tables long enough for `seq` when given)."""
        overrides = {"n_layers": self.layers} if self.layers else {}
        return llama_config(self.name, **overrides, **({"max_seq_len": seq} if seq else {}))


def parse_size(token: str) -> BenchSize:
    """The `BenchSize` of `token`; ValueError naming the part that is wrong and the syntax."""
    name, *settings = token.split(":")
    values: dict = {}
    for setting in settings:
        key, eq, value = setting.partition("=")
        if key == "ac" and not eq:
            values["ac"] = True
        elif key in ("layers", "batch") and eq and value.isdigit() and int(value) >= 1:
            values[key] = int(value)
        else:
            raise ValueError(f"size {token!r}: {setting!r} is not a setting; {_SYNTAX}")
    size = BenchSize(name=name, **values)
    size.model_config()  # an unknown name fails here
    return size
