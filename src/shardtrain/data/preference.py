"""Preference pairs for DPO: rows of prompt / chosen / rejected -> the token ids of both answers after one prompt.

    explicit prompt     {"prompt", "chosen", "rejected"}: strings, or lists of messages (TRL's conversational
                        layout: the prompt's turns, each answer its assistant turn(s))
    implicit prompt     {"chosen", "rejected"} only: two whole texts or conversations; the prompt is what they
                        share from the start (their longest common prefix of messages, or of characters)

The layouts and the prompt extraction are TRL's DPOTrainer's, so a preference dataset prepared for it
trains here as is. A string prompt is tokenized with the tokenizer's special tokens and each answer
without, an EOS appended; a conversation is rendered by the chat template, the prompt with the
generation prompt, and each answer is the text the whole chat adds to it. Both answers thus begin with
the very same prompt tokens, and only the answers' tokens are scored. A bad row (no rejected answer, the
two answers equal, an empty answer, a prompt leaving no room within seq_len) is one error naming the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .formats import without_nulls

PREFERENCE_COLUMNS = ("chosen", "rejected")


def is_preference(columns: list[str]) -> bool:
    """Whether rows with `columns` are preference pairs (a chosen and a rejected answer)."""
    return all(c in columns for c in PREFERENCE_COLUMNS)


def check_preference_columns(columns: list[str], *, where: str) -> None:
    """ValueError naming the missing column unless the rows hold preference pairs."""
    missing = [c for c in PREFERENCE_COLUMNS if c not in columns]
    if missing:
        raise ValueError(
            f"{where}: train.objective=dpo reads preference pairs, but the rows have {columns} (no {missing}); give "
            "rows with 'prompt', 'chosen' and 'rejected' (or 'chosen' and 'rejected' sharing their start)"
        )


def split_prompt(row: dict) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a row; without a prompt column, the answers' common start is the prompt."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None:
            raise ValueError(f"has no {name} answer (it is null); give both answers or drop the row")
    if row.get("prompt") is not None:
        return row["prompt"], chosen, rejected
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise ValueError("has a chosen and a rejected answer of different kinds (text and messages); give both alike")
    assert chosen is not None and rejected is not None  # checked above
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if isinstance(chosen, str) and 0 < shared < len(chosen) and chosen[shared - 1] == " ":
        shared -= 1  # the space before the answers belongs to them, as TRL splits it
    return chosen[:shared], chosen[shared:], rejected[shared:]


@dataclass(frozen=True, kw_only=True)
class PairEncoder:
    """Encodes preference rows for `datasets.map(batched=True, with_indices=True)`; picklable."""

    tokenizer: Any
    seq_len: int

    def encode(self, row: dict) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids, chosen answer ids, rejected answer ids) of one row, cut to seq_len."""
        prompt, chosen, rejected = split_prompt(row)
        if chosen == rejected:
            raise ValueError("has the same chosen and rejected answer; a pair must prefer one answer over another")
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer(prompt)["input_ids"]
            answers = [self._text_answer(a) for a in (chosen, rejected)]
        else:
            messages = [without_nulls(dict(m)) for m in prompt]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            answers = [self._chat_answer(messages, list(a), text) for a in (chosen, rejected)]
        for name, ids in zip(PREFERENCE_COLUMNS, answers):
            if not ids:
                raise ValueError(f"has an empty {name} answer (no token after the prompt); give it a completion")
        room = self.seq_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"has a prompt of {len(prompt_ids)} tokens, leaving no room for an answer within data.seq_len="
                f"{self.seq_len}; raise --data.seq_len or shorten the prompt"
            )
        return prompt_ids, answers[0][:room], answers[1][:room]

    def _text_answer(self, answer: str) -> list[int]:
        ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"] if answer else []
        eos = self.tokenizer.eos_token_id
        return ids + [eos] if ids and eos is not None and ids[-1] != eos else ids

    def _chat_answer(self, prompt: list[dict], answer: list[dict], prompt_text: str) -> list[int]:
        if not answer:
            return []
        whole = self.tokenizer.apply_chat_template(prompt + [without_nulls(dict(m)) for m in answer], tokenize=False)
        if not whole.startswith(prompt_text):
            raise ValueError(
                "renders its prompt differently alone and before the answer (the chat template is not prefix-stable); "
                "use a template that renders a conversation's start the same, or string prompts"
            )
        return self.tokenizer(whole[len(prompt_text) :], add_special_tokens=False)["input_ids"]

    def __call__(self, rows: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "row": []}
        for k, index in enumerate(indices):
            row = {name: column[k] for name, column in rows.items()}
            try:
                prompt_ids, chosen_ids, rejected_ids = self.encode(row)
            except ValueError as exc:
                raise ValueError(f"preference row {index} {exc}") from exc
            out["prompt_ids"].append(prompt_ids)
            out["chosen_ids"].append(chosen_ids)
            out["rejected_ids"].append(rejected_ids)
            out["row"].append(index)
        return out
