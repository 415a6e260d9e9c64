"""Byte sizes and durations as people write and read them (no torch)."""

from __future__ import annotations

import math
import numbers
import re

from autosplit import checks
from autosplit.checks import show
from autosplit.errors import ArgumentTypeError, InvalidInputError

__all__ = ["parse_bytes", "format_bytes", "size_at_least", "format_ms"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: float | str, name: str = "memory size") -> int:
    """``"16GiB"``, ``"512 MB"``, ``2**30`` or ``"1e9"`` → bytes (int).

    Args:
        value: a number of bytes or a string with an optional unit.
        name: the argument's name, for messages (e.g. ``"memory_per_gpu"``).

    Raises:
        ArgumentTypeError: ``value`` is neither a number nor a string (a bool, None, a list).
        InvalidInputError: the value is not a finite size of at least one byte with a known
            unit (0, negative, NaN and infinity are refused).
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise ArgumentTypeError(
            f"{name} must be a number of bytes or a string such as '16GiB', got {show(value)}"
        )
    if isinstance(value, numbers.Real):
        number, unit = checks.number(name, value), ""
    else:
        match = _SIZE.match(value)
        if match is None:
            try:
                number, unit = float(value), ""
            except ValueError:
                raise InvalidInputError(
                    f"cannot read {value!r} as {name}: write e.g. 16GiB, 512MiB or 8e9"
                ) from None
        else:
            number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        raise InvalidInputError(
            f"unknown unit {unit!r} in {name} {value!r}: use B, KB, MB, GB, KiB, MiB, GiB or TiB"
        )
    size = number * _UNITS[unit]
    if not (math.isfinite(size) and size >= 1):
        raise InvalidInputError(
            f"{name} must be a finite size of at least 1 byte, got {show(value)}"
        )
    return int(size)


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float | None) -> str:
    """``1536`` → ``"1.5 KiB"``; ``None`` → ``"–"``."""
    if n is None:
        return "–"
    size = float(n)
    for unit in _BINARY_UNITS:
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def size_at_least(n: float) -> str:
    """A size of at least ``n`` bytes that :func:`parse_bytes` reads, in
    :func:`format_bytes`'s unit but rounded up and without the space: ``"5.1KiB"`` for 5,130
    bytes (5.0098 KiB), ``"512B"``."""
    target = math.ceil(n)  # whole bytes, as parse_bytes reads them
    for i, unit in enumerate(_BINARY_UNITS):
        if target < 1024 ** (i + 1) or unit == "TiB":
            if unit == "B":
                return f"{target}B"
            tenths = math.ceil(target / 1024**i * 10)
            while int(tenths / 10 * 1024**i) < target:  # parse_bytes truncates to bytes
                tenths += 1
            return f"{tenths / 10:.1f}{unit}"
    raise AssertionError("unreachable")


def format_ms(ms: float) -> str:
    """Milliseconds, switching to seconds from 10 s: ``"812.3 ms"``, ``"12.41 s"``."""
    if ms >= 10_000:
        return f"{ms / 1000:.2f} s"
    if ms >= 100:
        return f"{ms:.0f} ms"
    return f"{ms:.1f} ms" if ms >= 1 else f"{ms:.3f} ms"
