"""The tokenizer a run trains with: transformers' `AutoTokenizer` from a folder, checked against the model.

With `--model.pretrained DIR` the tokenizer is DIR's own (`--data.tokenizer PATH` overrides); the
byte tokenizer stays the built-in model's default only. A tokenizer with more ids than the model has
embedding rows would index past the table, so it is refused, naming both sizes. `--data.chat_template`
replaces the tokenizer's chat template (a Jinja file, or the name of one of the templates the tokenizer
ships) before anything is rendered, so training, the cache key and the exported tokenizer all use it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from .deps import first_line, require

_GENERATION_MARK = re.compile(r"{%-?\s*generation\s*-?%}")


def load_tokenizer(path: str, *, key: str, chat_template: str | None = None):
    """`AutoTokenizer.from_pretrained(path)` (local only), its chat template replaced by `chat_template`
    (`use_chat_template`); ValueError naming `key` and the fix."""
    transformers = require("transformers", why=f"{key}={path!r}")
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ValueError(f"{key}={path!r} does not exist; pass a folder holding tokenizer.json / tokenizer_config.json")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        raise ValueError(
            f"{key}={path!r} holds no tokenizer transformers can load ({first_line(exc)}); pass --data.tokenizer FOLDER"
        ) from exc
    if not tokenizer.is_fast:
        raise ValueError(
            f"{key}={path!r} is a slow (Python) tokenizer; assistant masks need a fast one (a tokenizer.json)"
        )
    if chat_template is not None:
        use_chat_template(tokenizer, chat_template)
    return tokenizer


def use_chat_template(tokenizer, choice: str) -> None:
    """Make `choice` the tokenizer's chat template: the text of a Jinja file, or one of the named
    templates the tokenizer ships (e.g. "tool_use"); ValueError naming the choice and the fix."""
    shipped = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else {}
    file = Path(choice).expanduser()
    if file.is_file():
        tokenizer.chat_template = file.read_text()
    elif choice in shipped:
        tokenizer.chat_template = shipped[choice]
    else:
        names = f"the tokenizer ships {sorted(shipped)}" if shipped else "the tokenizer ships no named template"
        raise ValueError(
            f"data.chat_template={choice!r} is neither a file nor a named template ({names}); pass a Jinja file "
            "(e.g. chat.jinja) or one of those names"
        )


def check_vocab(tokenizer, *, embedding_rows: int, where: str) -> None:
    """A tokenizer whose ids reach past the model's embedding table is refused, naming both sizes."""
    if len(tokenizer) > embedding_rows:
        raise ValueError(
            f"the tokenizer of {where} has {len(tokenizer)} tokens but the model's embedding has "
            f"{embedding_rows} rows; use the model's own tokenizer (or resize the model's embedding to "
            f"at least {len(tokenizer)})"
        )


def has_generation_marks(tokenizer) -> bool:
    """Whether the chat template marks the assistant's tokens with `{% generation %}` ... `{% endgeneration %}`."""
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(_GENERATION_MARK.search(template))


def tokenizer_key(tokenizer) -> str:
    """A digest of everything in the tokenizer that changes the tokens: its model, normaliser, pre- and
    post-processor, special tokens and chat template (the cache key of the tokenized data)."""
    parts = [
        tokenizer.backend_tokenizer.to_str(),
        tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(tokenizer.chat_template),
        json.dumps({name: getattr(tokenizer, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
