"""What every configuration section is made of: a key's help and default, and the one-line check of its value."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names it and the fix."""


def help_field(text: str, default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A dataclass field with its help text (what `shardtrain train --help` prints) and default."""
    if default is dataclasses.MISSING:
        return field(metadata={"help": text}, **kwargs)
    return field(default=default, metadata={"help": text}, **kwargs)


def require(ok: bool, key: str, value: Any, remedy: str) -> None:
    """ConfigError naming `key`, its `value` and the `remedy` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {remedy}")
