"""Training windows as text with the trained spans marked, to see what the loss is taken on.

Each document of a window is decoded on a line of its own; the tokens the model is trained to produce
are wrapped in `[[` ... `]]` (a token is trained when the label one position before it is).
"""

from __future__ import annotations

from .pack import IGNORE

OPEN, CLOSE = "[[", "]]"


def render_window(tokenizer, window: dict) -> list[str]:
    """One string per document of `window` (input_ids, labels, position_ids), trained spans marked."""
    ids, labels, positions = window["input_ids"], window["labels"], window["position_ids"]
    starts = [t for t, p in enumerate(positions) if p == 0] + [len(ids)]
    return [_render(tokenizer, ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:])]


def _render(tokenizer, ids: list[int], labels: list[int]) -> str:
    trained = [False] + [label != IGNORE for label in labels[:-1]]
    parts, start = [], 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or trained[t] != trained[start]:
            text = tokenizer.decode(ids[start:t])
            parts.append(f"{OPEN}{text}{CLOSE}" if trained[start] else text)
            start = t
    return "".join(parts)


def show(windows, tokenizer, *, count: int) -> str:
    """The first `count` documents of `windows` (e.g. `Prepared.train`), rendered, each under a header."""
    lines: list[str] = []
    for w in range(len(windows)):
        for d, text in enumerate(render_window(tokenizer, windows[w])):
            if len(lines) == 2 * count:
                return "\n".join(lines)
            lines += [f"--- window {w}, document {d} ---", text]
    return "\n".join(lines)
