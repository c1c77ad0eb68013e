"""Documents -> training windows of at most seq_len tokens, with shifted labels and position ids.

A window is three equal-length lists: `input_ids`, `labels` and `position_ids`. Labels are already
shifted: `labels[t]` is the token the model must predict after reading `input_ids[: t + 1]` (the
document's next token), or -100 where nothing is trained (a prompt, a user turn, a document's last
token, padding). A model's logits at position t are scored against `labels[t]` directly.

With packing, documents are placed into windows by best-fit decreasing (within each `datasets.map`
batch), and `position_ids` restart at 0 at every document: the forward attends only within a run of
positions that starts at 0 (train/packed.py), so no document sees another. Without packing, each
document is its own window (padded when batched).
"""

from __future__ import annotations

import bisect

IGNORE = -100


def doc_labels(ids: list[int], trained: list[int]) -> list[int]:
    """labels[t] = ids[t + 1] where that token is trained, else -100; the last token predicts nothing."""
    return [nxt if flag else IGNORE for nxt, flag in zip(ids[1:], trained[1:])] + [IGNORE]


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= capacity: longest first, each into the fullest
    bin it fits (best-fit decreasing), a new bin where none fits."""
    bins: list[list[int]] = []
    space: list[tuple[int, int]] = []  # (room left, bin number), sorted
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(space, (lengths[i], -1))
        if at == len(space):
            bins.append([i])
            bisect.insort(space, (capacity - lengths[i], len(bins) - 1))
        else:
            room, b = space.pop(at)
            bins[b].append(i)
            bisect.insort(space, (room - lengths[i], b))
    return bins


def windows(docs: dict[str, list], *, seq_len: int, packing: bool) -> dict[str, list]:
    """`datasets.map(batched=True)` function: the batch's kept documents as windows."""
    kept = [i for i, k in enumerate(docs["kept"]) if k]
    ids = [docs["input_ids"][i] for i in kept]
    trained = [docs["trained"][i] for i in kept]
    groups = best_fit([len(x) for x in ids], seq_len) if packing else [[i] for i in range(len(ids))]
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    for group in groups:
        window_ids, labels, positions = [], [], []
        for i in group:
            window_ids += ids[i]
            labels += doc_labels(ids[i], trained[i])
            positions += list(range(len(ids[i])))
        out["input_ids"].append(window_ids)
        out["labels"].append(labels)
        out["position_ids"].append(positions)
    return out
