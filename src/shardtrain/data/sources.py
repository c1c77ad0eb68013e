"""Rows from what `--data.path` names, read by `datasets` into a memory-mapped Arrow table.

`load_rows` turns one source (a file, a folder, a save_to_disk folder, plain text, a Hub dataset id or
repo folder, with its config, split and revision) into rows; the kinds: docs/data.md, "What is read".
Every failure (missing path, unreadable or corrupt file, mixed kinds) is one ValueError line naming
the path and the fix; `datasets`' own tracebacks stay behind it.
"""

from __future__ import annotations

from pathlib import Path

from .deps import first_line, require
from .hub import hub_snapshot, is_hub_id

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def is_structured(path: str | None) -> bool:
    """Whether `path` holds rows for `datasets` (a data file, a folder of them, a saved dataset), not plain text."""
    if path is None:
        return False
    if is_hub_id(path):
        return True
    root = Path(path).expanduser()
    if root.is_file():
        return root.suffix.lower() in BUILDERS
    if root.is_dir():
        return any((root / m).exists() for m in SAVED_MARKERS) or bool(_data_files(root))
    return False


def _data_files(root: Path) -> list[Path]:
    return sorted(f for f in root.rglob("*") if f.is_file() and f.suffix.lower() in BUILDERS)


def load_rows(
    path: str,
    *,
    config: str | None = None,
    split: str = "train",
    revision: str | None = None,
    key: str = "data.path",
    pattern: str = "**/*",
    cache_dir: str | None = None,
    streaming: bool = False,
):
    """A `datasets.Dataset` of the rows of one source: `path` (a local path or a Hub dataset id) with its
    `config`, `split` and `revision` (see the module docstring); ValueError with the fix. `streaming`: a
    `datasets.IterableDataset` instead, which reads the rows as they are iterated (nothing cached)."""
    datasets = require("datasets", why=f"{key}={path!r}")
    root = Path(path).expanduser()
    if not root.exists():
        if not is_hub_id(path):
            raise ValueError(
                f"{key}={path!r} does not exist; pass an existing file or folder, or a Hub dataset id (org/name)"
            )
        folder = hub_snapshot(path, kind="dataset", key=key, revision=revision, local="file or folder")
        return _repo(
            datasets, folder, name=path, config=config, split=split, key=key, cache_dir=cache_dir, streaming=streaming
        )
    if revision is not None:
        raise ValueError(
            f"data.revision={revision!r} picks a version of a Hub dataset, but {key}={path!r} is a local path; "
            "drop --data.revision"
        )
    if root.is_dir() and any((root / m).exists() for m in SAVED_MARKERS):
        saved = _saved(datasets, root, key=key, split=split, config=config)
        return saved.to_iterable_dataset() if streaming else saved
    if root.is_dir() and (_declares_configs(root) or config is not None or split != "train"):
        return _repo(
            datasets, root, name=path, config=config, split=split, key=key, cache_dir=cache_dir, streaming=streaming
        )
    if config is not None or split != "train":
        raise ValueError(
            f"data.config / data.split pick a part of a Hub dataset, but {key}={path!r} is a single file, read "
            "whole; drop --data.config and --data.split"
        )
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
            streaming=streaming,
            **extra,
        )
    except Exception as exc:
        raise ValueError(
            f"{key}={path!r}: cannot read it as {builder} ({first_line(exc)}); check the file is complete "
            "and of the kind its suffix says"
        ) from exc


def _declares_configs(root: Path) -> bool:
    """Whether `root` is a Hub dataset repo's folder: a README.md whose YAML front matter lists `configs`."""
    from huggingface_hub.repocard import metadata_load

    card = root / "README.md"
    try:
        return card.is_file() and "configs" in (metadata_load(card) or {})
    except Exception:  # a README that is no dataset card (no YAML, or other YAML): not a Hub layout
        return False


def _repo(
    datasets,
    root: Path,
    *,
    name: str,
    config: str | None,
    split: str,
    key: str,
    cache_dir: str | None,
    streaming: bool = False,
):
    """The rows of `config`'s `split` of a Hub dataset repo's folder, by the Hub's layout rules."""
    try:
        return datasets.load_dataset(
            str(root),
            name=config,
            split=split,
            cache_dir=None if cache_dir is None else str(Path(cache_dir) / "datasets"),
            streaming=streaming,
        )
    except Exception as exc:
        raise ValueError(
            f"{key}={name!r}: cannot load config {config or 'default'!r}, split {split!r} ({first_line(exc)}); "
            f"it has {_parts(datasets, root, config)}: pick them with --data.config / --data.split"
        ) from exc


def _parts(datasets, root: Path, config: str | None) -> str:
    """The configs of the repo at `root`, and the splits of `config` if it is one of them."""
    try:
        configs = datasets.get_dataset_config_names(str(root))
        if config is not None and config not in configs:
            return f"configs {configs}"
        return f"splits {datasets.get_dataset_split_names(str(root), config)} (configs {configs})"
    except Exception as exc:
        return f"no readable layout ({first_line(exc)})"


def _saved(datasets, root: Path, *, key: str, split: str, config: str | None):
    if config is not None:
        raise ValueError(
            f"data.config={config!r} names a config of a Hub dataset, but {key}={str(root)!r} is a saved "
            "dataset (it has none); drop --data.config"
        )
    try:
        loaded = datasets.load_from_disk(str(root))
    except Exception as exc:
        raise ValueError(f"{key}={str(root)!r}: cannot load the saved dataset ({first_line(exc)})") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(
                f"{key}={str(root)!r} is a DatasetDict without a {split!r} split (it has {list(loaded)}); "
                "pick one with --data.split"
            )
        return loaded[split]
    if split != "train":
        raise ValueError(
            f"data.split={split!r} picks a split, but {key}={str(root)!r} is a single saved Dataset; drop --data.split"
        )
    return loaded
