"""Human-readable sizes: parameter counts ("7B", "350M") and byte amounts ("80GiB", "141GB").

Counts use decimal suffixes (K, M, B/G, T = 10^3 ... 10^12), as model names do. Byte amounts
accept decimal units (KB, MB, GB, TB), binary units (KiB, MiB, GiB, TiB) and the bare letters
K, M, G, T, which mean the binary units, as in `nvidia-smi` and container memory limits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

GiB = 1 << 30

_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_BYTE_SUFFIX = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def _split(text: str) -> tuple[float, str] | None:
    match = _NUMBER.match(text)
    return (float(match.group(1)), match.group(2).lower()) if match else None


def _parse_quantity(
    value: str | int | float, *, table: Mapping[str, float], what: str, noun: str, forms: str, minimum: float
) -> float:
    """`value` (a number, or a number with a suffix of `table`) scaled by its suffix."""
    example = forms.split(",")[0].split(" or ")[0].strip()
    if isinstance(value, bool):
        raise ValueError(f"{what}={value!r} is not a {noun}; give a number or a string such as {example}")
    if isinstance(value, (int, float)):
        number, suffix = float(value), ""
    else:
        parsed = _split(str(value))
        if parsed is None or parsed[1] not in table:
            raise ValueError(f"{what}={value!r} is not a {noun}; write it as {forms}")
        number, suffix = parsed
    scaled = number * table[suffix]
    if not math.isfinite(scaled) or scaled < minimum:
        raise ValueError(f"{what}={value!r} must be a positive {noun}, such as {example}")
    return scaled


def parse_count(value: str | int | float, *, what: str = "params") -> int:
    """Parse a parameter count: 7e9, "7B", "1.5b", "350M", "125k" -> int."""
    return int(
        round(
            _parse_quantity(
                value,
                table=_COUNT_SUFFIX,
                what=what,
                noun="parameter count",
                minimum=1,
                forms="'7B', '1.5b' or '350M' (a number with an optional K / M / B / T suffix)",
            )
        )
    )


def parse_bytes(value: str | int | float, *, what: str = "device_memory") -> int:
    """Parse a memory size: 80 * 2**30, "80GiB", "141GB", "80G" (= GiB), "512MiB" -> int bytes."""
    return int(
        _parse_quantity(
            value,
            table=_BYTE_SUFFIX,
            what=what,
            noun="memory size",
            minimum=1,
            forms="'80GiB', '141GB', '80G' (GiB) or '512MiB'",
        )
    )


def format_count(count: int) -> str:
    """7_241_732_096 -> '7.24B'."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return str(count)


def format_gib(nbytes: int | float) -> str:
    """Bytes as GiB with two decimals (the unit `torch.cuda.max_memory_allocated` readers expect)."""
    return f"{nbytes / GiB:.2f}"
