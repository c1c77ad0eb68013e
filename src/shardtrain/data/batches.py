"""Batches for one rank: its slice of each global micro-batch of windows, in a seeded order per epoch.

A batch is the dict every training step reads, the contract with train/packed.py (its fields and
padding: docs/data.md, "Batches and packing"). Sample i of the run is a pure function of (seed, i) and
each rank takes its own contiguous slice of the global micro-batch, so ranks read disjoint windows and
a resumed run reads exactly the same batches. Held-out windows are read in order, each once; a partial
last micro-batch is padded so that every rank runs the same forwards.
"""

from __future__ import annotations

import numpy as np
import torch

from .pack import IGNORE


class WindowOrder:
    """Which window global sample `i` reads: a permutation per epoch drawn from the seed (in order
    without shuffling), and this rank's sample numbers of micro-batch `index`. `holds` says what the
    windows are made of, for the error when training windows are fewer than one micro-batch (a batch
    would read some twice) or there is no held-out window."""

    def __init__(
        self, num_windows: int, *, holds: str, global_batch: int, rank: int, world_size: int, seed: int, shuffle: bool
    ):
        if global_batch % world_size:
            raise ValueError(
                f"a global micro-batch of {global_batch} sequences does not split over {world_size} "
                "ranks; use a batch size that is a multiple of the world size"
            )
        if shuffle and num_windows < global_batch:
            raise ValueError(
                f"the training data: {holds}, fewer than one batch of {global_batch}; use more data or a smaller "
                "data.seq_len / train.batch_size"
            )
        if not shuffle and num_windows < 1:
            raise ValueError(
                f"the held-out data (data.val_fraction or data.eval_path): {holds}, none to evaluate; hold out "
                "more data, use a smaller data.seq_len, or --data.val_fraction 0 to train without evaluation"
            )
        self.num_windows = num_windows
        self.global_batch = global_batch
        self.per_rank = global_batch // world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = -1
        self._perm: np.ndarray = np.arange(0)  # the epoch's order, drawn at its first window

    def window(self, sample: int) -> int:
        epoch, pos = divmod(sample, self.num_windows)
        if not self.shuffle:
            return pos
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._epoch = epoch
        return int(self._perm[pos])

    def samples(self, index: int) -> list[int]:
        """Global sample numbers of this rank's part of micro-batch `index`."""
        start = index * self.global_batch + self.rank * self.per_rank
        return list(range(start, start + self.per_rank))

    def windows_of(self, index: int) -> list[int | None]:
        """The windows of this rank's part of micro-batch `index`; held out, None past the last window
        (a padding row: nothing trained)."""
        return [None if not self.shuffle and s >= self.num_windows else self.window(s) for s in self.samples(index)]

    def held_out_batches(self, limit: int) -> int:
        """Micro-batches one evaluation reads: all the windows once (the last batch partial), or at most
        `limit` batches when `limit` > 0. The same on every rank: each runs as many forwards."""
        whole = -(-self.num_windows // self.global_batch)
        return min(whole, limit) if limit else whole


class WindowBatches(WindowOrder):
    """Batches of windows (rows with input_ids, labels, position_ids; e.g. a memory-mapped `datasets.Dataset`)."""

    all_trained = False  # labels hold -100s: the step counts its trained tokens

    def __init__(self, windows, *, seq_len: int, pad_id: int, **order) -> None:
        n = len(windows)
        super().__init__(n, holds=f"{n} windows of at most {seq_len} tokens", **order)
        self.windows = windows
        self.seq_len = seq_len
        self.pad_id = pad_id

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        picked = self.windows_of(index)
        real = [b for b, w in enumerate(picked) if w is not None]  # the rest stay padding rows
        rows = self.windows[[picked[b] for b in real]]
        return dense_batch(
            zip(real, rows["input_ids"], rows["labels"], rows["position_ids"]),
            rows=self.per_rank,
            seq_len=self.seq_len,
            pad_id=self.pad_id,
        )


def dense_batch(windows, *, rows: int, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The batch dict of `rows` rows from `windows`, (row, input_ids, labels, position_ids) tuples: each
    window at the start of its row, the rest padding (a run of its own, from 0), every tensor dense."""
    shape = (rows, seq_len)
    ids = np.full(shape, pad_id, dtype=np.int64)
    labels = np.full(shape, IGNORE, dtype=np.int64)
    positions = np.tile(np.arange(seq_len, dtype=np.int64), (rows, 1))
    for b, i, lab, pos in windows:
        n = len(i)
        ids[b, :n], labels[b, :n], positions[b, :n] = i, lab, pos
        positions[b, n:] -= n
    return {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(positions),
    }
