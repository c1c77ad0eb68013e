"""Held-out prompts to decode during training: what the model is asked, and the answer the data gives.

messages             the conversation up to its last assistant turn, rendered with the
                     generation prompt; the reference is that turn's content
prompt_completion    the prompt's tokens; the reference is the completion
text                 the first half of the text's tokens; the reference is the rest
"""

from __future__ import annotations

from .formats import Format, conversation_of


def held_out_prompts(rows, fmt: Format, tokenizer, *, count: int) -> list[dict]:
    """Up to `count` prompts {"prompt_ids": [...], "reference": str} from the first held-out rows."""
    out = []
    for k in range(min(count, len(rows))):
        row = rows[k]
        messages = conversation_of(row, fmt)
        if messages is not None:
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            if last is None:
                continue
            ids = tokenizer.apply_chat_template(
                messages[:last], tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
            out.append({"prompt_ids": list(ids), "reference": messages[last]["content"]})
        elif fmt is Format.PROMPT_COMPLETION:
            out.append({"prompt_ids": tokenizer(row["prompt"])["input_ids"], "reference": row["completion"]})
        else:
            ids = tokenizer(row["text"])["input_ids"]
            half = max(1, len(ids) // 2)
            out.append({"prompt_ids": ids[:half], "reference": tokenizer.decode(ids[half:], skip_special_tokens=True)})
    return out
