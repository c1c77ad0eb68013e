"""Streamed training data (`--data.streaming true`): rows read, tokenized and packed as training goes.

Per source, this rank's share of the rows is encoded row by row, packed a buffer at a time and queued
by a background thread; each window of a batch comes from the source furthest below its share of the
trained tokens (`neediest`). Nothing is written to disk, so a corpus larger than the disk trains, and
each source's StreamPosition in the rank's checkpoint lets a resumed run read exactly the batches of
the uninterrupted one (docs/data.md, "Streaming").
"""

from __future__ import annotations

import atexit
import gc
import itertools
import json
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from .batches import dense_batch
from .encode import Encoder
from .pack import IGNORE, windows
from .pipeline import DataSpec, read_source, untrained_row

Window = tuple[list[int], list[int], list[int]]  # input_ids, labels, position_ids
DOC_FIELDS = ("input_ids", "trained", "row", "truncated", "kept", "n_trained")
_JOIN_TIMEOUT_S = 30.0  # a thread mid-row (a slow remote shard, say) gets this long to reach its next put


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


@dataclass(frozen=True, kw_only=True)
class StreamSource:
    """One source of a stream: this rank's rows (`open_rows()` gives a fresh IterableDataset of them),
    how they are encoded, how errors call them (`where`) and reports and metrics (`name`)."""

    open_rows: Callable[[], Any]
    encoder: Encoder
    where: str
    name: str = ""


def neediest(weights: list[float], trained: list[int]) -> int:
    """The source furthest below its share (`weights`, summing to 1) of the `trained` tokens so far; the
    first of the heaviest at the start. Drawing each window from it keeps every source's share of the
    trained tokens within one window of its weight, whatever the lengths of its rows."""
    total = sum(trained)
    return max(range(len(weights)), key=lambda s: (weights[s] * total - trained[s], weights[s], -s))


def describe_served(names: list[str], *, weights: list[float], served: np.ndarray) -> str:
    """One line per source of what its stream served this run (`served`: StreamBatches.served summed over
    the ranks): its weight and share of the trained tokens, its rows (documents), tokens and windows."""
    total = max(1, int(served[:, 3].sum()))
    return "\n".join(
        f"{name}: {weight:.1%} of the trained tokens aimed, {trained / total:.1%} this run; {docs:,} rows "
        f"streamed, {trained:,} of {tokens:,} tokens trained, {windows:,} windows"
        for name, weight, (windows, docs, tokens, trained) in zip(names, weights, served.tolist())
    )


@dataclass(frozen=True)
class _Failed:
    error: BaseException


def _read_ahead(items: Iterator, out: queue.Queue, stop: threading.Event) -> None:
    """Put `items` into the bounded queue `out` until `stop` is set; an error is put there too, for the reader.
    The generator is closed in this thread when it ends, so the row readers it holds are released here."""
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
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()


class StreamBatches:
    """Training batches of one rank from the streams of windows of one or several sources (the batch dict
    of data/batches.py).

    Each window of a batch comes from the source `neediest` names (with one source: that one), so each
    source's share of the trained tokens follows its weight (a share of the trained tokens, as
    data/mixing.py's). `batch(index)` serves consecutive indices from 0 (or from the resumed position);
    a background thread per source packs ahead into a queue of `read_ahead` micro-batches, so the step
    does not wait for tokenizing. `state_dict()` / `load_state_dict()` save and restore every source's
    position and trained tokens (plain values: the checkpoint stores them in this rank's file).
    `served[s]` counts source s's windows, documents, tokens and trained tokens read in this run."""

    all_trained = False  # labels hold -100s: the step counts its trained tokens
    num_windows = None  # unknown until the stream ends: train.epochs cannot count passes

    def __init__(
        self,
        sources: list[StreamSource],
        *,
        weights: list[float] | None = None,
        pad_id: int,
        global_batch: int,
        rank: int,
        world_size: int,
        packing: bool,
        buffer: int,
        seed: int,
        read_ahead: int = 8,
    ) -> None:
        if global_batch % world_size:
            raise ValueError(
                f"a global micro-batch of {global_batch} sequences does not split over {world_size} "
                "ranks; use a batch size that is a multiple of the world size"
            )
        weights = weights or [1.0] * len(sources)
        self.weights = [w / sum(weights) for w in weights]
        self.sources = sources
        self.per_rank = global_batch // world_size
        self.rank, self.world_size = rank, world_size
        self.seq_len = sources[0].encoder.seq_len
        self.pad_id = pad_id
        self.next_index = 0
        self.positions = [StreamPosition() for _ in sources]
        self.trained = [0] * len(sources)  # since the run's start, resumes included: what neediest weighs
        self.served = np.zeros((len(sources), 4), dtype=np.int64)  # windows, documents, tokens, trained tokens
        self._windows: dict[str, Any] = dict(buffer=buffer, packing=packing, seed=seed, shuffle=True)
        self._read_ahead = read_ahead
        self._queues: list[queue.Queue] = []
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._exit_hook_registered = False

    def first_windows(self, source: int, count: int) -> list[dict[str, list[int]]]:
        """The first `count` windows of `source`'s stream in file order (for `--data.show`; a fresh read)."""
        s = self.sources[source]
        items = stream_windows(s.open_rows, encoder=s.encoder, where=s.where, **{**self._windows, "shuffle": False})
        firsts = [window for (window, _) in itertools.islice(items, count)]
        return [dict(zip(("input_ids", "labels", "position_ids"), window)) for window in firsts]

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        if index != self.next_index:
            raise ValueError(
                f"streamed data is read in order: batch {index} was asked for, the stream is at batch "
                f"{self.next_index}; resume from a checkpoint to go back, or train without --data.streaming"
            )
        self.start()
        picked = []
        for _ in range(self.per_rank):
            s = neediest(self.weights, self.trained)
            window, self.positions[s] = self._take(s)
            trained = sum(label != IGNORE for label in window[1])
            self.trained[s] += trained
            self.served[s] += (1, window[2].count(0), len(window[0]), trained)
            picked.append(window)
        self.next_index += 1
        rows = ((b, *window) for b, window in enumerate(picked))
        return dense_batch(rows, rows=self.per_rank, seq_len=self.seq_len, pad_id=self.pad_id)

    def start(self) -> None:
        """Start reading ahead (once; the first batch does it otherwise), so that the first buffers are
        tokenized while the model is built. A position loaded afterwards starts the reading again."""
        if self._queues:
            return
        if not self._exit_hook_registered:  # a run closes its streams; this covers every other way out
            atexit.register(_close_at_exit, weakref.ref(self))
            self._exit_hook_registered = True
        for s, position in zip(self.sources, self.positions):
            out: queue.Queue = queue.Queue(maxsize=self._read_ahead * self.per_rank)
            items = stream_windows(s.open_rows, encoder=s.encoder, where=s.where, start=position, **self._windows)
            thread = threading.Thread(
                target=_read_ahead, args=(items, out, self._stop), name=f"shardtrain-stream-{s.name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
            self._queues.append(out)

    def close(self) -> None:
        """Stop reading ahead and wait for the reading threads to end (each within one put or one row).

        Note: a row reader left alive into interpreter shutdown can abort the process there
        ("terminate called without an active exception": pyarrow's reader threads outlive the
        memory they use); closing the streams while everything is alive prevents that. The training
        loop closes them when it ends; an exit hook, registered when reading starts, closes them on
        any other way out (an error before the loop, a loop of one's own that does not call this).
        A later `batch()` starts reading again from the current positions."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=_JOIN_TIMEOUT_S)
        self._stop, self._queues, self._threads = threading.Event(), [], []
        gc.collect()  # the readers' reference cycles go now, not at shutdown

    def _take(self, source: int) -> tuple[Window, StreamPosition]:
        item = self._queues[source].get()
        if isinstance(item, _Failed):
            raise item.error
        return item

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_index": self.next_index,
            "rank": self.rank,
            "world_size": self.world_size,
            "sources": [s.name for s in self.sources],
            "positions": [asdict(p) for p in self.positions],
            "trained": [int(t) for t in self.trained],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"the checkpoint's stream position is rank {state['rank']} of {state['world_size']}, this is rank "
                f"{self.rank} of {self.world_size}; resume streamed data on {state['world_size']} data-parallel ranks"
            )
        names = [s.name for s in self.sources]
        if state["sources"] != names:
            raise ValueError(
                f"the checkpoint streamed the sources {state['sources']}, this run streams {names}; resume with "
                "the checkpoint's data.sources"
            )
        if self.next_index:
            raise RuntimeError("load a stream position before reading the first batch")
        if self._queues:  # read ahead from the start: those threads end, new ones read from the position
            self.close()
        self.next_index = int(state["next_index"])
        self.positions = [StreamPosition(**p) for p in state["positions"]]
        self.trained = [int(t) for t in state["trained"]]

    def __del__(self) -> None:
        self._stop.set()  # the reading threads hold no reference to self: they end at their next put


def _close_at_exit(ref: weakref.ref) -> None:
    batches = ref()
    if batches is not None:
        batches.close()
