"""Rows from what `--data.path` names, read by `datasets` into a memory-mapped Arrow table.

    file.jsonl / .json / .parquet / .arrow / .csv    that file
    a folder of such files                            all of them (one kind per folder)
    a folder written by Dataset.save_to_disk          that dataset (its 'train' split for a DatasetDict)
    plain text files (or a folder of them)            one row {"text": ...} per file

Every failure (missing path, unreadable or corrupt file, mixed kinds) is one ValueError line naming
the path and the fix; `datasets`' own tracebacks stay behind it.
"""

from __future__ import annotations

from pathlib import Path

from .deps import first_line, require

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def is_structured(path: str | None) -> bool:
    """Whether `path` holds rows for `datasets` (a data file, a folder of them, a saved dataset), not plain text."""
    if path is None:
        return False
    root = Path(path).expanduser()
    if root.is_file():
        return root.suffix.lower() in BUILDERS
    if root.is_dir():
        return any((root / m).exists() for m in SAVED_MARKERS) or bool(_data_files(root))
    return False


def _data_files(root: Path) -> list[Path]:
    return sorted(f for f in root.rglob("*") if f.is_file() and f.suffix.lower() in BUILDERS)


def load_rows(path: str, *, key: str = "data.path", pattern: str = "**/*", cache_dir: str | None = None):
    """A `datasets.Dataset` of the rows at `path` (see the module docstring); ValueError with the fix."""
    datasets = require("datasets", why=f"{key}={path!r}")
    root = Path(path).expanduser()
    if not root.exists():
        raise ValueError(f"{key}={path!r} does not exist; pass an existing file or folder")
    if root.is_dir() and any((root / m).exists() for m in SAVED_MARKERS):
        return _saved(datasets, root, key=key)
    if root.is_file():
        files = [root]
    else:
        files = _data_files(root) or sorted(f for f in root.glob(pattern) if f.is_file())
    if not files:
        raise ValueError(f"{key}={path!r} holds no file matching {pattern!r}; pass a data file or set --data.pattern")
    kinds = {BUILDERS.get(f.suffix.lower(), "text") for f in files}
    if len(kinds) > 1:
        raise ValueError(
            f"{key}={path!r} mixes file kinds {sorted(kinds)}; put one kind of file per folder or pass a single file"
        )
    builder = kinds.pop()
    extra = {"sample_by": "document"} if builder == "text" else {}
    try:
        return datasets.load_dataset(
            builder,
            data_files=[str(f) for f in files],
            split="train",
            cache_dir=None if cache_dir is None else str(Path(cache_dir) / "datasets"),
            **extra,
        )
    except Exception as exc:
        raise ValueError(
            f"{key}={path!r}: cannot read it as {builder} ({first_line(exc)}); check the file is complete "
            "and of the kind its suffix says"
        ) from exc


def _saved(datasets, root: Path, *, key: str):
    try:
        loaded = datasets.load_from_disk(str(root))
    except Exception as exc:
        raise ValueError(f"{key}={str(root)!r}: cannot load the saved dataset ({first_line(exc)})") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"{key}={str(root)!r} is a DatasetDict without a 'train' split (it has {list(loaded)})")
        return loaded["train"]
    return loaded
