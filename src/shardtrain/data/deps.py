"""The optional libraries the data path stands on, imported only when a run needs them.

The built-in model trains on the byte corpus with no extra package; a tokenizer, a chat template or a
`datasets` file format needs the `hf` extra, and a missing one is one line naming the install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = "pip install 'shardtrain[hf]'"


def require(name: str, *, why: str) -> ModuleType:
    """Import `name` (datasets, transformers); ValueError naming the extra to install when it is missing."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"{why} needs the {name} package: {INSTALL}") from exc


def first_line(exc: BaseException) -> str:
    """The innermost cause of a library's error, on one line: its type and the first line of its message
    (datasets wraps pyarrow's errors, transformers its file readers')."""
    while (inner := exc.__cause__ or exc.__context__) is not None:
        exc = inner
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
