"""Argument checks shared by the public functions (no torch).

Each check takes the argument's name and value and returns the value in a normal form, or
raises: :class:`~autosplit.errors.ArgumentTypeError` (also a ``TypeError``) for a value of the
wrong type, :class:`~autosplit.errors.InvalidInputError` (also a ``ValueError``) for a value
of the right type that is not acceptable. Messages name the argument and the value given, e.g.
``bandwidth_bytes_per_s must be a finite number > 0, got 0``. ``bool`` is not a number here.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, TypeVar

from autosplit.errors import ArgumentTypeError, InvalidInputError

__all__ = [
    "show",
    "integer",
    "positive_int",
    "non_negative_int",
    "number",
    "positive_finite",
    "non_negative_finite",
    "one_of",
    "device_name",
    "sequence_of",
    "instance_of",
    "text",
    "optional",
    "as_sequence",
    "known_options",
]

T = TypeVar("T")


def show(value: Any) -> str:
    """The value as a message quotes it: its repr, shortened, with its type when not obvious."""
    text_ = repr(value)
    if len(text_) > 60:
        text_ = text_[:57] + "..."
    if isinstance(value, (bool, int, float, str)) or value is None:
        return text_
    return f"{text_} ({type(value).__name__})"


def integer(name: str, value: Any) -> int:
    """``value`` as an int; a bool, float, string or None is an :class:`ArgumentTypeError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an integer, got {show(value)}")
    return int(value)


def positive_int(name: str, value: Any) -> int:
    """An integer ≥ 1."""
    n = integer(name, value)
    if n < 1:
        raise InvalidInputError(f"{name} must be a positive integer, got {n}")
    return n


def non_negative_int(name: str, value: Any) -> int:
    """An integer ≥ 0."""
    n = integer(name, value)
    if n < 0:
        raise InvalidInputError(f"{name} must be an integer ≥ 0, got {n}")
    return n


def number(name: str, value: Any) -> float:
    """``value`` as a float (NaN and ±inf pass); a bool, string or None is refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number, got {show(value)}")
    try:
        return float(value)
    except OverflowError:  # an int too large for a float
        return math.inf if value > 0 else -math.inf


def positive_finite(name: str, value: Any, unit: str = "") -> float:
    """A finite number > 0 (``unit`` is named in the message, e.g. ``"bytes/s"``)."""
    x = number(name, value)
    if not (math.isfinite(x) and x > 0):
        suffix = f" ({unit})" if unit else ""
        raise InvalidInputError(f"{name} must be a finite number > 0{suffix}, got {show(value)}")
    return x


def non_negative_finite(name: str, value: Any, unit: str = "") -> float:
    """A finite number ≥ 0."""
    x = number(name, value)
    if not (math.isfinite(x) and x >= 0):
        suffix = f" ({unit})" if unit else ""
        raise InvalidInputError(f"{name} must be a finite number ≥ 0{suffix}, got {show(value)}")
    return x


def text(name: str, value: Any) -> str:
    """A non-empty string."""
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a string, got {show(value)}")
    if not value.strip():
        raise InvalidInputError(f"{name} must not be empty, got {show(value)}")
    return value


def device_name(name: str, value: Any) -> str:
    """A device: a non-empty string such as ``"cuda:0"``, or a ``torch.device`` (as its str)."""
    if type(value).__name__ == "device" and hasattr(value, "type"):  # torch.device, no import
        return str(value)
    return text(name, value)


def one_of(name: str, value: Any, choices: Collection[str]) -> str:
    """One of the names in ``choices``."""
    if not isinstance(value, str):
        raise ArgumentTypeError(
            f"{name} must be one of {', '.join(choices)}, got {show(value)}"
        )
    if value not in choices:
        raise InvalidInputError(
            f"unknown {name} {value!r}: use one of {', '.join(choices)}"
        )
    return value


def instance_of(name: str, value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    """``value`` when it is a ``kind`` (``what`` says what is expected, e.g. ``"a Profile"``)."""
    if not isinstance(value, kind):
        raise ArgumentTypeError(f"{name} must be {what}, got {show(value)}")
    return value


def sequence_of(
    name: str,
    value: Any,
    item: Callable[[str, Any], T],
    *,
    length: int | None = None,
    per: str = "",
    allow_empty: bool = False,
) -> tuple[T, ...]:
    """A list or tuple (or other finite iterable, not a string or mapping) of checked items.

    Args:
        name: the argument's name; items are named ``name[i]``.
        value: the value given.
        item: the check of each item, e.g. :func:`positive_int`.
        length: the number of items required, if fixed.
        per: what each item stands for when ``length`` is given (``"stage"``: "one per stage").
        allow_empty: accept an empty sequence.
    """
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ArgumentTypeError(f"{name} must be a list, got {show(value)}")
    items = list(value)
    if length is not None and len(items) != length:
        each = f" (one per {per})" if per else ""
        raise InvalidInputError(f"{name} must have {length} entries{each}, got {len(items)}")
    if not items and not allow_empty:
        raise InvalidInputError(f"{name} is empty: give at least one entry")
    return tuple(item(f"{name}[{i}]", v) for i, v in enumerate(items))


def optional(check: Callable[..., T], name: str, value: Any, *args: Any) -> T | None:
    """``None`` stays ``None`` (the documented default); anything else goes through ``check``."""
    return None if value is None else check(name, value, *args)


def as_sequence(name: str, value: Any) -> Sequence[Any]:
    """A list or tuple as given (e.g. of names checked elsewhere); a string is refused."""
    return sequence_of(name, value, lambda _n, v: v, allow_empty=True)


def known_options(cls: type[T]) -> type[T]:
    """A class decorator for an options record (a dataclass; put it above ``@dataclass``): a
    keyword that is not one of the record's fields, or more positional values than it has,
    raises ``ArgumentTypeError`` naming the record, the keyword and the nearest field, where
    Python's own ``__init__`` raises a bare ``TypeError``. ``dataclasses.replace`` goes
    through it too."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    init = cls.__init__

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(names):
            raise ArgumentTypeError(
                f"{cls.__name__} takes at most {len(names)} values ({', '.join(names)}), "
                f"got {len(args)}: name them")
        for key in kwargs:
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1)
                hint = f"did you mean {near[0]}? " if near else ""
                raise ArgumentTypeError(
                    f"{cls.__name__} has no option {key!r}: {hint}its options are "
                    f"{', '.join(names)}")
        init(self, *args, **kwargs)

    cls.__init__ = checked  # type: ignore[method-assign]
    return cls
