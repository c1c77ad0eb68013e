"""Human-readable sizes: parameter counts ("7B", "350M") and byte amounts ("80GiB", "141GB").

Counts use decimal suffixes (K, M, B/G, T = 10^3 ... 10^12), as model names do. Byte amounts
accept decimal units (KB, MB, GB, TB), binary units (KiB, MiB, GiB, TiB) and the bare letters
K, M, G, T, which mean the binary units, as in `nvidia-smi` and container memory limits.
"""

from __future__ import annotations

import math
import re

GiB = 1 << 30

_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_BYTE_SUFFIX = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def _split(text: str) -> tuple[float, str] | None:
    match = _NUMBER.match(text)
    return (float(match.group(1)), match.group(2).lower()) if match else None


def parse_count(value: str | int | float, *, what: str = "params") -> int:
    """Parse a parameter count: 7e9, "7B", "1.5b", "350M", "125k" -> int."""
    if isinstance(value, bool):
        raise ValueError(f"{what}={value!r} is not a parameter count; give a number such as 7e9 or '7B'")
    if isinstance(value, (int, float)):
        number, suffix = float(value), ""
    else:
        parsed = _split(str(value))
        if parsed is None or parsed[1] not in _COUNT_SUFFIX:
            raise ValueError(
                f"{what}={value!r} is not a parameter count; write a number with an optional "
                "K / M / B / T suffix, such as '7B', '1.5b' or '350M'"
            )
        number, suffix = parsed
    count = number * _COUNT_SUFFIX[suffix]
    if not math.isfinite(count) or count < 1:
        raise ValueError(f"{what}={value!r} must be a positive parameter count, such as '7B'")
    return int(round(count))


def parse_bytes(value: str | int | float, *, what: str = "device_memory") -> int:
    """Parse a memory size: 80 * 2**30, "80GiB", "141GB", "80G" (= GiB), "512MiB" -> int bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{what}={value!r} is not a memory size; give bytes or a string such as '80GiB'")
    if isinstance(value, (int, float)):
        number, suffix = float(value), ""
    else:
        parsed = _split(str(value))
        if parsed is None or parsed[1] not in _BYTE_SUFFIX:
            raise ValueError(
                f"{what}={value!r} is not a memory size; write a number with a unit such as "
                "'80GiB', '141GB', '80G' (GiB) or '512MiB'"
            )
        number, suffix = parsed
    size = number * _BYTE_SUFFIX[suffix]
    if not math.isfinite(size) or size <= 0:
        raise ValueError(f"{what}={value!r} must be a positive memory size, such as '80GiB'")
    return int(size)


def format_count(count: int) -> str:
    """7_241_732_096 -> '7.24B'."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return str(count)


def format_gib(nbytes: int | float) -> str:
    """Bytes as GiB with two decimals (the unit `torch.cuda.max_memory_allocated` readers expect)."""
    return f"{nbytes / GiB:.2f}"
