"""Streamed training data (`--data.streaming true`): rows read, tokenized and packed as training goes.

    this rank's share of the rows (a `datasets.IterableDataset`, split_dataset_by_node)
        -> Encoder, row by row -> a buffer of at least data.stream_buffer documents (whole rows)
        -> windows by best-fit within the buffer (pack.windows), in a seeded order per buffer
        -> a bounded queue, filled by a background thread -> batch(index), consecutive indices only

Nothing is written to disk, so a corpus larger than the disk trains, and the first step waits for one
buffer, not for the corpus. At the end of the rows the stream starts the next pass from the start.

Where the stream stands (a StreamPosition: the row stream's `state_dict()` at the start of the buffer
being served, the pass, buffer and row numbers there, and the windows of that buffer served) is saved in
each rank's checkpoint file: resuming reads that buffer again, packs it the same way and skips what was
served, so a resumed run reads exactly the batches of the uninterrupted one. With one rank, no shuffling
and a buffer of pipeline.PACK_GROUP documents, the windows are the cached path's, which packs its
documents in groups of that many.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np
import torch

from .batches import dense_batch
from .encode import Encoder
from .pack import windows
from .pipeline import DataSpec, read_source, untrained_row

Window = tuple[list[int], list[int], list[int]]  # input_ids, labels, position_ids
DOC_FIELDS = ("input_ids", "trained", "row", "truncated", "kept", "n_trained")


@dataclass(frozen=True, kw_only=True)
class StreamPosition:
    """Where a rank's stream stands: what resuming needs to serve the next window again."""

    rows: str | None = None  # the row stream's state_dict (JSON) at the buffer's start; None: the pass's start
    passes: int = 0  # passes over the rows finished
    buffer: int = 0  # buffers packed before this one in this pass
    row: int = 0  # rows of this rank's share read before the buffer, in this pass
    served: int = 0  # windows of the buffer already served


def stream_rows(spec: DataSpec, *, tokenizer, cache_dir: str | None, rank: int, world_size: int):
    """This rank's share of `spec`'s rows, read as iterated: whole files (shards) per rank where they split
    evenly over the ranks, else every world_size-th row (datasets' split_dataset_by_node); disjoint shares
    whose union is every row."""
    from datasets.distributed import split_dataset_by_node

    rows, _ = read_source(spec, tokenizer=tokenizer, cache_dir=cache_dir, progress=False, streaming=True)
    return split_dataset_by_node(rows, rank=rank, world_size=world_size)


def stream_windows(
    open_rows: Callable[[], Any],
    *,
    encoder: Encoder,
    buffer: int,
    packing: bool,
    seed: int,
    shuffle: bool,
    where: str,
    start: StreamPosition | None = None,
) -> Iterator[tuple[Window, StreamPosition]]:
    """Every window of the stream from `start`, each with the position after it, pass after pass.
    `open_rows()` gives a fresh IterableDataset of this rank's rows; `where` names them in errors."""
    position = start or StreamPosition()
    while True:
        rows = open_rows()
        if position.rows is not None:
            rows.load_state_dict(json.loads(position.rows))
        row, served_any = position.row, position.served > 0 or position.buffer > 0
        docs: dict[str, list] = {name: [] for name in DOC_FIELDS}
        for record in rows:
            encoded = encoder({name: [value] for name, value in record.items()}, [row])
            _check_trained(encoded, where=where, seq_len=encoder.seq_len)
            for name in DOC_FIELDS:
                docs[name] += encoded[name]
            row += 1
            if len(docs["kept"]) >= buffer:
                for item in _packed(
                    docs, position, packing=packing, seq_len=encoder.seq_len, seed=seed, shuffle=shuffle
                ):
                    served_any = True
                    yield item
                docs = {name: [] for name in DOC_FIELDS}
                state = json.dumps(rows.state_dict())
                position = StreamPosition(rows=state, passes=position.passes, buffer=position.buffer + 1, row=row)
        for item in _packed(docs, position, packing=packing, seq_len=encoder.seq_len, seed=seed, shuffle=shuffle):
            served_any = True
            yield item
        if not served_any:
            raise ValueError(
                f"{where}: this rank's share of the rows makes no window (too few rows for the ranks, or every "
                "row dropped); use more rows or fewer ranks"
            )
        position = StreamPosition(passes=position.passes + 1)


def _check_trained(encoded: dict[str, list], *, where: str, seq_len: int) -> None:
    for kept, trained, row, truncated in zip(
        encoded["kept"], encoded["n_trained"], encoded["row"], encoded["truncated"]
    ):
        if kept and not trained:
            raise untrained_row(row, truncated=truncated, where=where, seq_len=seq_len, like="other rows may be")


def _packed(
    docs: dict[str, list], position: StreamPosition, *, packing: bool, seq_len: int, seed: int, shuffle: bool
) -> Iterator[tuple[Window, StreamPosition]]:
    """The buffer's windows not served yet, in order (shuffle: a permutation drawn from the seed, the pass
    and the buffer number), each with the position after it."""
    out = windows(docs, seq_len=seq_len, packing=packing)
    count = len(out["input_ids"])
    order = np.random.default_rng([seed, position.passes, position.buffer]).permutation(count) if shuffle else None
    for k in range(position.served, count):
        w = int(order[k]) if order is not None else k
        yield (out["input_ids"][w], out["labels"][w], out["position_ids"][w]), replace(position, served=k + 1)


@dataclass(frozen=True)
class _Failed:
    error: BaseException


def _read_ahead(items: Iterator, out: queue.Queue, stop: threading.Event) -> None:
    """Put `items` into the bounded queue `out` until `stop` is set; an error is put there too, for the reader."""
    try:
        for item in items:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if stop.is_set():
                return
    except BaseException as exc:  # handed to the training thread, which raises it
        out.put(_Failed(exc))


class StreamBatches:
    """Training batches of one rank from its stream of windows (the batch dict of data/batches.py).

    `batch(index)` serves consecutive indices from 0 (or from the resumed position); a background thread
    packs ahead into a queue of `read_ahead` micro-batches, so the step does not wait for tokenizing.
    `state_dict()` / `load_state_dict()` save and restore the position (plain values: the checkpoint
    stores them in this rank's file)."""

    all_trained = False  # labels hold -100s: the step counts its trained tokens
    num_windows = None  # unknown until the stream ends: train.epochs cannot count passes

    def __init__(
        self,
        open_rows: Callable[[], Any],
        *,
        encoder: Encoder,
        pad_id: int,
        global_batch: int,
        rank: int,
        world_size: int,
        packing: bool,
        buffer: int,
        seed: int,
        where: str,
        read_ahead: int = 8,
    ) -> None:
        if global_batch % world_size:
            raise ValueError(
                f"a global micro-batch of {global_batch} sequences does not split over {world_size} "
                "ranks; use a batch size that is a multiple of the world size"
            )
        self.per_rank = global_batch // world_size
        self.rank, self.world_size = rank, world_size
        self.seq_len = encoder.seq_len
        self.pad_id = pad_id
        self.next_index = 0
        self.position = StreamPosition()
        self._windows: dict[str, Any] = dict(
            open_rows=open_rows, encoder=encoder, buffer=buffer, packing=packing, seed=seed, shuffle=True, where=where
        )
        self._read_ahead = read_ahead
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        if index != self.next_index:
            raise ValueError(
                f"streamed data is read in order: batch {index} was asked for, the stream is at batch "
                f"{self.next_index}; resume from a checkpoint to go back, or train without --data.streaming"
            )
        if self._queue is None:
            self._queue = queue.Queue(maxsize=self._read_ahead * self.per_rank)
            items = stream_windows(**self._windows, start=self.position)
            threading.Thread(target=_read_ahead, args=(items, self._queue, self._stop), daemon=True).start()
        picked = [self._take() for _ in range(self.per_rank)]
        self.position = picked[-1][1]
        self.next_index += 1
        rows = ((b, *window) for b, (window, _) in enumerate(picked))
        return dense_batch(rows, rows=self.per_rank, seq_len=self.seq_len, pad_id=self.pad_id)

    def _take(self) -> tuple[Window, StreamPosition]:
        item = self._queue.get()  # type: ignore[union-attr]  # batch() started it
        if isinstance(item, _Failed):
            raise item.error
        return item

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_index": self.next_index,
            "rank": self.rank,
            "world_size": self.world_size,
            **asdict(self.position),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"the checkpoint's stream position is rank {state['rank']} of {state['world_size']}, this is rank "
                f"{self.rank} of {self.world_size}; resume streamed data on {state['world_size']} data-parallel ranks"
            )
        if self._queue is not None:
            raise RuntimeError("load a stream position before reading the first batch")
        self.next_index = int(state["next_index"])
        self.position = StreamPosition(**{f.name: state[f.name] for f in fields(StreamPosition)})

    def __del__(self) -> None:
        self._stop.set()  # the reading thread holds no reference to self: it ends at its next put
