"""Which layout a dataset's rows have, from their columns, and the conversions to the common ones.

    text                  {"text": "..."}: causal LM, every token trained
    prompt_completion     {"prompt": "...", "completion": "..."}: only the completion trained
    messages              {"messages": [{"role": ..., "content": ...}, ...]}: OpenAI chat, only the
                          assistant turns trained; ShareGPT's {"conversations": [{"from", "value"}]}
                          is converted to it

The names and the rules are those of TRL's SFTTrainer, so a dataset prepared for it trains here as is.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class Format(enum.Enum):
    TEXT = "text"
    PROMPT_COMPLETION = "prompt_completion"
    MESSAGES = "messages"


FORMAT_NAMES = ("auto", *(f.value for f in Format))
SHAREGPT = "conversations"
_REQUIRED = {Format.TEXT: ("text",), Format.PROMPT_COMPLETION: ("prompt", "completion"), Format.MESSAGES: ("messages",)}
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def detect_format(columns: Sequence[str], *, forced: str, where: str) -> Format:
    """The rows' format: `forced` (a Format value) if given, else the first layout the columns match.

    `where` names the data in the message of an unknown layout (ValueError, one line).
    """
    columns = list(columns)
    if forced != "auto":
        fmt = Format(forced)
        missing = [
            c for c in _REQUIRED[fmt] if c not in columns and not (fmt is Format.MESSAGES and SHAREGPT in columns)
        ]
        if missing:
            raise ValueError(
                f"{where}: data.format={forced!r} needs the column(s) {missing}, but the rows have {columns}; "
                "rename the columns or pick the matching --data.format"
            )
        return fmt
    if "messages" in columns or SHAREGPT in columns:
        return Format.MESSAGES
    if "prompt" in columns and "completion" in columns:
        return Format.PROMPT_COMPLETION
    if "text" in columns:
        return Format.TEXT
    raise ValueError(
        f"{where}: the rows have the columns {columns}, which match no known layout; expected 'text', "
        "'prompt' + 'completion', 'messages' (OpenAI chat) or 'conversations' (ShareGPT); rename the "
        "columns or pass --data.format"
    )


def messages_of(row: dict) -> list[dict]:
    """The row's conversation as OpenAI messages (role, content), converting ShareGPT's from/value."""
    if "messages" in row and row["messages"] is not None:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    turns = row[SHAREGPT]
    try:
        return [{"role": _SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
    except KeyError as exc:
        raise ValueError(
            f"a ShareGPT turn has the role {exc.args[0]!r}; known roles are {sorted(_SHAREGPT_ROLES)}"
        ) from exc


def conversation_of(row: dict, fmt: Format) -> list[dict] | None:
    """The row as a chat to render with the template: a `messages` (or ShareGPT) row, or a conversational
    prompt/completion (lists of messages: the prompt's turns, then the completion's); None for a plain
    `text` or string prompt/completion row."""
    if fmt is Format.MESSAGES:
        return messages_of(row)
    if fmt is Format.PROMPT_COMPLETION and not isinstance(row["prompt"], str):
        return list(row["prompt"]) + list(row["completion"])
    return None
