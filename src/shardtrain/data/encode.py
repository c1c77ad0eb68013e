"""One dataset row -> its tokens and which of them are trained, as SFT fine-tuners expect.

Text, prompt/completion and chat rows are encoded as docs/data.md says ("What is read", "Tokenizer",
"Loss masks"): exactly one BOS, and every trained span ending with the template's end of turn or the
tokenizer's EOS, so the model learns to stop. `trained[i]` says whether token i is a target (predicted
from tokens < i); the first token never is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from .deps import first_line
from .formats import Format, conversation_of, messages_of, tools_of
from .tokenizer import has_generation_marks


class TrainOn(enum.Enum):
    COMPLETION = "completion"  # the completion / the assistant turns
    ALL = "all"


class Overlong(enum.Enum):
    TRUNCATE = "truncate"  # keep the first seq_len tokens
    DROP = "drop"  # leave the row out (counted)


@dataclass(frozen=True, kw_only=True)
class Encoder:
    """Encodes rows for `datasets.map(batched=True, with_indices=True)`; picklable for worker processes."""

    tokenizer: Any
    format: Format
    train_on: TrainOn
    seq_len: int
    overlong: Overlong

    def encode(self, row: dict) -> tuple[list[int], list[int]]:
        """(token ids, trained flags) of one row, before any cut to seq_len."""
        conversation = conversation_of(row, self.format)
        if conversation is not None:
            ids, trained = chat_tokens(self.tokenizer, conversation, tools=tools_of(row))
        elif self.format is Format.TEXT:
            ids, trained = self._with_eos(self.tokenizer(row["text"])["input_ids"]), None
        else:
            ids, trained = self._prompt_completion(row["prompt"], row["completion"])
        if trained is None or self.train_on is TrainOn.ALL:
            trained = [1] * len(ids)
        return one_bos(ids, trained, self.tokenizer.bos_token_id)

    def _with_eos(self, ids: list[int]) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids

    def _prompt_completion(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        ids = self._with_eos(self.tokenizer(prompt + completion)["input_ids"])
        start = len(self.tokenizer(prompt)["input_ids"])
        return ids, [0] * start + [1] * (len(ids) - start)

    def __call__(self, rows: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "trained": [], "row": [], "truncated": [], "kept": [], "n_trained": []}
        for k, index in enumerate(indices):
            row = {name: column[k] for name, column in rows.items()}
            try:
                ids, trained = self.encode(row)
            except (TemplateError, TypeError) as exc:  # the template met a field it cannot render
                what = _what_failed(row, self.format, self.tokenizer)
                raise ValueError(f"data row {index}: {what} ({first_line(exc)})") from exc
            except ValueError as exc:
                raise ValueError(f"data row {index}: {exc}") from exc
            pieces, truncated, kept = [(ids, trained)], False, True
            if len(ids) > self.seq_len:
                if self.format is Format.TEXT:
                    pieces = [
                        (ids[s : s + self.seq_len], trained[s : s + self.seq_len])
                        for s in range(0, len(ids), self.seq_len)
                    ]
                    pieces = [p for p in pieces if len(p[0]) > 1]
                elif self.overlong is Overlong.TRUNCATE:
                    pieces, truncated = [(ids[: self.seq_len], trained[: self.seq_len])], True
                else:
                    pieces, kept = [([], [])], False
            for piece_ids, piece_trained in pieces:
                out["input_ids"].append(piece_ids)
                out["trained"].append(piece_trained)
                out["row"].append(index)
                out["truncated"].append(truncated)
                out["kept"].append(kept)
                out["n_trained"].append(sum(piece_trained[1:]))
        return out


def one_bos(ids: list[int], trained: list[int], bos: int | None) -> tuple[list[int], list[int]]:
    """Collapse a doubled leading BOS (template + tokenizer both adding one) into one."""
    start = 0
    while bos is not None and start + 1 < len(ids) and ids[start] == bos and ids[start + 1] == bos:
        start += 1
    return ids[start:], trained[start:]


def _what_failed(row: dict, fmt: Format, tokenizer) -> str:
    """Which part of a row failed to encode, for the one-line error: the chat's fields and the first message
    (or the tools) the template fails on, or the format's columns."""
    conversation = row.get("messages") or row.get("conversations")
    if fmt is not Format.MESSAGES or not isinstance(conversation, list):
        return f"cannot be encoded as {fmt.value} rows (columns {sorted(row)})"
    fields = sorted({k for m in conversation if isinstance(m, dict) for k, v in m.items() if v is not None})
    tools = "with" if row.get("tools") else "without"
    return (
        f"the chat template cannot render its messages (fields {fields}, {tools} tools{_failing_part(row, tokenizer)}); "
        "fix the row, or pick a template that handles them with --data.chat_template"
    )


def _failing_part(row: dict, tokenizer) -> str:
    """'; first at message i: role R, fields [...]' for the shortest prefix of the row's chat the template
    cannot render ('; at the tools' where the first message renders without them); '' where none is found."""
    messages, tools = messages_of(row), tools_of(row)
    for i, message in enumerate(messages):
        if _renders(tokenizer, messages[: i + 1], tools):
            continue
        if i == 0 and tools is not None and _renders(tokenizer, messages[:1], None):
            return "; at the tools"
        fields = sorted(k for k, v in message.items() if v is not None)
        return f"; first at message {i}: role {message.get('role')!r}, fields {fields}"
    return ""


def _renders(tokenizer, messages: list[dict], tools: list[dict] | None) -> bool:
    try:
        tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    except (TemplateError, TypeError):
        return False
    return True


def chat_tokens(tokenizer, messages: list[dict], *, tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """The conversation's tokens and assistant mask, by the template's generation marks or by prefixes;
    `tools` (JSON schemas) are rendered by the template as it renders them."""
    if has_generation_marks(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
    return _chat_by_prefixes(tokenizer, messages, tools=tools)


def _chat_by_prefixes(tokenizer, messages: list[dict], *, tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """Without generation marks: assistant turn i is the text that rendering messages[: i + 1] adds to
    rendering messages[:i] with the generation prompt; tokens starting inside it are trained."""

    def render(upto: int, prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=False, add_generation_prompt=prompt)

    text = render(len(messages), False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(i, True), render(i + 1, False)
        if not (text.startswith(before) and text.startswith(through) and through.startswith(before)):
            raise ValueError(
                "the chat template renders a conversation's prefix differently from the whole (it is not "
                "prefix-stable), so the assistant turns cannot be found; add {% generation %} marks to it "
                "or use --data.train_on all"
            )
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    trained = [int(any(a <= start < b for a, b in spans)) for start, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), trained
