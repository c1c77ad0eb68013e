"""One training source of `[[data.sources]]`: where its rows are, how to read them, and its part of the mix.

A run names one source with `--data.path` or several with `data.sources` (a list of these tables);
`DataConfig.source_list` resolves either spelling to a tuple of sources once, so the rest of the code knows one form.
A source's format, train_on and val_fraction left unset take the data section's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from ..data.encode import TrainOn
from ..data.formats import FORMAT_NAMES
from .section_fields import help_field


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    name: str | None = help_field(
        "the source's name in metrics (eval/loss/<name>); default: its file's or folder's name without the "
        "extension, or the last part of its Hub id",
        None,
    )
    path: str | None = help_field("the source's rows: a file, a folder or a Hub dataset id, as data.path takes", None)
    config: str | None = help_field("the config (subset) of a Hub dataset", None)
    split: str = help_field("the split of a Hub dataset (or a saved DatasetDict)", "train")
    revision: str | None = help_field("the branch, tag or commit of a Hub dataset id", None)
    format: str | None = help_field("row layout, as data.format (default: data.format)", None)
    columns: dict[str, str] = help_field(
        "renames the source's columns before its format is detected, e.g. {question: prompt, answer: completion}",
        default_factory=dict,
    )
    train_on: str | None = help_field("'completion' or 'all', as data.train_on (default: data.train_on)", None)
    weight: float | None = help_field("the source's share of the trained tokens (normalized over the sources)", None)
    epochs: float | None = help_field(
        "passes over the source's windows per epoch of the mix (instead of a weight)", None
    )
    eval_path: str | None = help_field("the source's held-out rows (instead of its val_fraction)", None)
    val_fraction: float | None = help_field(
        "the fraction of the source's rows held out (default: data.val_fraction)", None
    )


def check_sources(sources: tuple[SourceConfig, ...], *, path: str | None, streaming: bool, require) -> None:
    """Every source's values and the mix as a whole (`streaming`: as data.streaming reads them);
    `require(ok, key, value, remedy)` raises the ConfigError."""
    require(
        not (sources and path is not None),
        "data.path",
        path,
        "give one source with --data.path or several with data.sources, not both",
    )
    for i, source in enumerate(sources):
        key = f"data.sources.{i}"
        require(source.path is not None, f"{key}.path", None, "every source needs a path (a file, folder or Hub id)")
        require(
            source.format is None or source.format in FORMAT_NAMES,
            f"{key}.format",
            source.format,
            f"use one of {', '.join(FORMAT_NAMES)}",
        )
        trains = tuple(t.value for t in TrainOn)
        require(
            source.train_on is None or source.train_on in trains,
            f"{key}.train_on",
            source.train_on,
            f"use one of {', '.join(trains)}",
        )
        require(
            source.weight is None or source.epochs is None,
            f"{key}.epochs",
            source.epochs,
            "a source gives a weight (its share of the mix) or an epoch count, not both",
        )
        require(source.weight is None or source.weight >= 0, f"{key}.weight", source.weight, "use a share of 0 or more")
        require(source.epochs is None or source.epochs > 0, f"{key}.epochs", source.epochs, "use a positive count")
        require(
            source.val_fraction is None or 0 <= source.val_fraction < 1,
            f"{key}.val_fraction",
            source.val_fraction,
            "use a value in [0, 1) (0: hold out nothing)",
        )
        require(
            not (streaming and source.val_fraction),
            f"{key}.val_fraction",
            source.val_fraction,
            "streamed rows are never counted, so none are held out by a fraction: give the source an eval_path",
        )
        require(
            not (streaming and source.weight is None and len(sources) > 1),
            f"{key}.weight",
            source.weight,
            "streamed sources are never counted, so they mix by weight only: give every source a weight",
        )
    weighted = [s.weight is not None for s in sources]
    require(
        not any(weighted) or all(weighted),
        "data.sources",
        [s.weight for s in sources],
        "give every source a weight, or none (each source's share then follows its epochs x windows; epochs unset: 1)",
    )
    require(
        not any(weighted) or sum(s.weight or 0 for s in sources) > 0,
        "data.sources",
        [s.weight for s in sources],
        "the weights sum to 0: give at least one source a positive weight",
    )


def source_labels(sources: tuple[SourceConfig, ...]) -> list[str]:
    """Each source's name in metrics: its `name`, else its path's last part without the extension; a name
    given twice gets -2, -3, ... after the first."""
    labels: list[str] = []
    for source in sources:
        base = source.name or PurePosixPath(str(source.path).rstrip("/")).name.split(".")[0] or "source"
        label, n = base, 1
        while label in labels:
            n += 1
            label = f"{base}-{n}"
        labels.append(label)
    return labels
