"""Several sources in one training stream: global sample i -> (source, window), a pure function of (seed, i).

The stream is cut into blocks of BLOCK samples. Every block holds each source's share of it exactly
(its count, by largest remainder of BLOCK x share), at positions a seeded shuffle of the block draws,
so the k-th sample of source s in block b is that source's sample b x count_s + k: no history to replay.
A source's samples visit its windows in a permutation per pass drawn from (seed, s, pass), as one
source's do (batches.py). Ranks take contiguous slices of each global micro-batch (WindowOrder), so they
read disjoint windows, and a resumed run reads exactly the batches the uninterrupted one would have.

Weights are shares of the trained tokens, turned into shares of the sampled windows by each source's
trained tokens per window (shares_of); `MixedBatches` counts each source's trained tokens as it reads
them, for the run summary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .batches import WindowBatches
from .pack import IGNORE
from .pipeline import DataStats

BLOCK = 4096  # samples per block: each source's share is exact to 1/BLOCK within each one
_MIX = 0x6D6978  # separates the blocks' seeds from the sources' permutation seeds


def shares_of(
    *, windows: list[int], trained: list[int], weights: list[float | None], epochs: list[float | None]
) -> tuple[list[float], int]:
    """(each source's share of the sampled windows, samples in one epoch of the mix), from each source's
    windows and trained tokens.

    Weights are shares of the trained tokens: a source's windows are drawn in proportion to its weight over
    its trained tokens per window, so a source of half-empty windows is drawn twice as often. An epoch is
    then as many samples as all the sources hold windows. Otherwise (epochs, unset: 1) a source's share of
    the windows is epochs x windows over the total, and an epoch of the mix reads each source its epochs times."""
    if all(w is not None for w in weights):
        draws = [w * n / max(1, t) for w, n, t in zip(weights, windows, trained)]  # type: ignore[operator]
        return [d / sum(draws) for d in draws], sum(windows)
    passes = [e if e is not None else 1.0 for e in epochs]
    reads = [e * n for e, n in zip(passes, windows)]
    return [r / sum(reads) for r in reads], max(1, round(sum(reads)))


def block_counts(shares: list[float], *, names: list[str]) -> np.ndarray:
    """Each source's samples per block (largest remainder); a positive share too small for one is an error."""
    exact = np.asarray(shares, dtype=np.float64) * BLOCK
    counts = np.floor(exact).astype(np.int64)
    rest = BLOCK - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:rest]] += 1
    starved = [names[s] for s in range(len(shares)) if shares[s] > 0 and counts[s] == 0]
    if starved:
        raise ValueError(
            f"the source(s) {starved} have a share under 1/{BLOCK} of the mix and would never be read; "
            "raise their weight (or epochs), or leave them out"
        )
    return counts


class MixedOrder:
    """Which (source, window of that source) global sample `i` reads."""

    def __init__(self, *, windows: list[int], counts: np.ndarray, seed: int) -> None:
        self.windows = windows
        self.counts = counts
        self.seed = seed
        self._block = -1
        self._sources = np.zeros(0, dtype=np.int64)
        self._ranks = np.zeros(0, dtype=np.int64)
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    def locate(self, sample: int) -> tuple[int, int]:
        block, pos = divmod(sample, BLOCK)
        if block != self._block:
            sources = np.repeat(np.arange(len(self.counts)), self.counts)
            np.random.default_rng([self.seed, _MIX, block]).shuffle(sources)
            ranks = np.zeros(BLOCK, dtype=np.int64)
            for s in range(len(self.counts)):
                at = np.flatnonzero(sources == s)
                ranks[at] = np.arange(len(at))
            self._block, self._sources, self._ranks = block, sources, ranks
        source = int(self._sources[pos])
        passes, k = divmod(block * int(self.counts[source]) + int(self._ranks[pos]), self.windows[source])
        cached = self._perms.get(source)
        if cached is None or cached[0] != passes:
            cached = (passes, np.random.default_rng([self.seed, source, passes]).permutation(self.windows[source]))
            self._perms[source] = cached
        return source, int(cached[1][k])


class MixedBatches(WindowBatches):
    """Training batches over several sources' windows (`datasets` tables, concatenated), mixed by `shares`.

    `num_windows` is the samples in one epoch of the mix (shares_of), what train.epochs counts;
    `trained_tokens[s]` counts the tokens this rank trained on from source s so far."""

    def __init__(
        self, sources: list, *, names: list[str], shares: list[float], epoch_samples: int, seed: int, **windows
    ) -> None:
        from datasets import concatenate_datasets

        sizes = [len(s) for s in sources]
        super().__init__(concatenate_datasets(sources), shuffle=True, seed=seed, **windows)
        self.names = names
        self.parts = sources  # each source's windows
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.order = MixedOrder(windows=sizes, counts=block_counts(shares, names=names), seed=seed)
        self.num_windows = epoch_samples
        self.trained_tokens = np.zeros(len(sources), dtype=np.int64)

    def window(self, sample: int) -> int:
        source, window = self.order.locate(sample)
        return int(self.offsets[source] + window)

    def source_of(self, sample: int) -> int:
        return self.order.locate(sample)[0]

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        batch = super().batch(index)
        trained = (batch["labels"] != IGNORE).sum(dim=1).numpy()
        np.add.at(self.trained_tokens, [self.source_of(s) for s in self.samples(index)], trained)
        return batch


def source_name(path: str, *, config: str | None = None, split: str = "train") -> str:
    """A source as the reports name it: its path or Hub id, with a config and a split other than train."""
    return path + (f" [{config}]" if config else "") + (f" ({split})" if split != "train" else "")


@dataclass(frozen=True, kw_only=True)
class MixStats:
    """Each source's DataStats and share of the mix, for the run summary and `--data.show`."""

    names: list[str]
    stats: list[DataStats]
    shares: list[float]  # of the sampled windows

    def describe(self, trained_tokens: np.ndarray | None = None) -> str:
        """One line per source: its name and `per_source` line."""
        return "\n".join(f"{name}: {line}" for name, line in zip(self.names, self.per_source(trained_tokens)))

    def per_source(self, trained_tokens: np.ndarray | None = None) -> list[str]:
        """Each source's share of the trained tokens the mix aims at and of the windows drawn, its share of
        the tokens trained this run (given each source's count), its rows and tokens."""
        expected = [share * st.supervised_tokens / max(1, st.windows) for share, st in zip(self.shares, self.stats)]
        total = None if trained_tokens is None else max(1, int(np.sum(trained_tokens)))
        lines = []
        for s, stats in enumerate(self.stats):
            run = "" if total is None else f", {trained_tokens[s] / total:.1%} this run"  # type: ignore[index]
            lines.append(
                f"{expected[s] / sum(expected):.1%} of the trained tokens ({self.shares[s]:.1%} of the "
                f"windows){run}; {stats.describe()}"
            )
        return lines
