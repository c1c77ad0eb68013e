"""Which layout a dataset's rows have, from their columns, and the conversions to the common ones.

    text                  {"text": "..."}: causal LM, every token trained
    prompt_completion     {"prompt": "...", "completion": "..."}: only the completion trained
    messages              {"messages": [{"role": ..., "content": ...}, ...]}: OpenAI chat, only the
                          assistant turns trained; ShareGPT's {"conversations": [{"from", "value"}]}
                          is converted to it. Function calling: a message's `tool_calls`, `name` and
                          `tool_call_id`, and the row's `tools` (JSON schemas, or one JSON string of
                          them), reach the chat template

The names and the rules are those of TRL's SFTTrainer, so a dataset prepared for it trains here as is.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from typing import Any


class Format(enum.Enum):
    TEXT = "text"
    PROMPT_COMPLETION = "prompt_completion"
    MESSAGES = "messages"


FORMAT_NAMES = ("auto", *(f.value for f in Format))
SHAREGPT = "conversations"
_REQUIRED = {Format.TEXT: ("text",), Format.PROMPT_COMPLETION: ("prompt", "completion"), Format.MESSAGES: ("messages",)}
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# A message's fields beside role and content that chat templates read (OpenAI's function-calling layout).
TOOL_FIELDS = ("tool_calls", "name", "tool_call_id")


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


def without_nulls(value: Any) -> Any:
    """`value` with every None-valued key of its dicts dropped, recursively.

    Why: Arrow stores a column's rows under one schema, so a key one row's message (or tool schema) has
    and another's lacks reads back as None in the other; a template must see it absent, not null.
    """
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def messages_of(row: dict) -> list[dict]:
    """The row's conversation as OpenAI messages (role, content, and the function-calling fields a
    message has), converting ShareGPT's from/value."""
    if "messages" in row and row["messages"] is not None:
        return [
            {"role": m["role"], "content": m.get("content")}
            | {k: without_nulls(m[k]) for k in TOOL_FIELDS if m.get(k) is not None}
            for m in row["messages"]
        ]
    turns = row[SHAREGPT]
    try:
        return [{"role": _SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
    except KeyError as exc:
        raise ValueError(
            f"a ShareGPT turn has the role {exc.args[0]!r}; known roles are {sorted(_SHAREGPT_ROLES)}"
        ) from exc


def tools_of(row: dict) -> list[dict] | None:
    """The row's `tools` (JSON schemas of the functions the assistant may call) for the chat template, or None.
    A JSON string (how many datasets store them, Arrow needing one schema per column) is parsed."""
    tools = row.get("tools")
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the row's tools is a string but not JSON ({exc}); give a list of JSON schemas") from exc
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"the row's tools is {type(tools).__name__}; give a list of JSON schemas (dicts)")
    return without_nulls(tools)


def conversation_of(row: dict, fmt: Format) -> list[dict] | None:
    """The row as a chat to render with the template: a `messages` (or ShareGPT) row, or a conversational
    prompt/completion (lists of messages: the prompt's turns, then the completion's); None for a plain
    `text` or string prompt/completion row."""
    if fmt is Format.MESSAGES:
        return messages_of(row)
    if fmt is Format.PROMPT_COMPLETION and not isinstance(row["prompt"], str):
        return list(row["prompt"]) + list(row["completion"])
    return None
