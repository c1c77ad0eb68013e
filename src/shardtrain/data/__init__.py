"""Fine-tuning data: the user's rows, tokenized by the model's own tokenizer, loss-masked and packed.

The pieces `shardtrain train` uses (`load_tokenizer`, `load_rows`, `prepare`, `WindowBatches`,
`StreamBatches`, `Encoder`, `show`), exported for a loop of one's own: docs/data.md, "In your own loop".

Names are imported lazily: `import shardtrain.data` needs neither datasets nor transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataSpec": "pipeline",
    "Prepared": "pipeline",
    "prepare": "pipeline",
    "load_rows": "sources",
    "load_tokenizer": "tokenizer",
    "Format": "formats",
    "detect_format": "formats",
    "Encoder": "encode",
    "TrainOn": "encode",
    "Overlong": "encode",
    "chat_tokens": "encode",
    "WindowBatches": "batches",
    "StreamBatches": "stream",
    "StreamSource": "stream",
    "stream_rows": "stream",
    "IGNORE": "pack",
    "show": "display",
    "render_window": "display",
    "held_out_prompts": "prompts",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardtrain.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
