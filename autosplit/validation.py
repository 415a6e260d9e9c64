"""Field checks shared by the records (Profile, Plan and their parts); no torch import.

Each check raises :class:`RecordError` naming the field by its path inside the record
(``stages[1].blocks``, ``blocks[3].fwd_ms[0]``) and saying what is wrong with the value and
what it must be. The records call their invariants (``check_profile``, ``check_plan`` …,
:mod:`autosplit.record_invariants`) from ``__post_init__``, so a record built in Python is checked as one
read from JSON; :mod:`autosplit.record_json` prefixes the path of a nested record while reading
and turns the error into a :class:`~autosplit.errors.PlanFileError` naming the file.

This module sits below :mod:`autosplit.records` and imports nothing of autosplit but errors.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Sequence
from typing import Any

from autosplit.errors import InvalidInputError

__all__ = [
    "KNOWN_SCHEDULES",
    "KNOWN_OPTIMIZERS",
    "MAX_INT",
    "RecordError",
    "show",
    "join_path",
    "check_size",
    "check_count",
    "check_bytes",
    "check_ms",
    "check_text",
    "check_flag",
    "check_choice",
    "check_row",
    "check_length",
    "check_unique",
    "SHARED_MODES",
    "checked",
    "is_a",
]

KNOWN_SCHEDULES = ("gpipe", "1f1b", "looped-bfs", "interleaved-1f1b", "interleaved-zb", "zbv",
                   "dualpipev")
"""Schedule names a plan may carry (:func:`autosplit.cost.in_flight` knows these)."""

SHARED_MODES = ("one stage", "one rank", "all-reduce")
"""How a plan keeps a weight that several stages use equal (see ``SharedWeight.mode``)."""

KNOWN_OPTIMIZERS = ("none", "sgd", "sgd-momentum", "adagrad", "adam", "adamw", "adam-mixed")
"""Optimizer names a plan may carry: the keys of :data:`autosplit.cost.OPTIMIZER_STATE`."""

MAX_INT = 2**63 - 1
"""Largest integer a record holds (sizes, counts, bytes): what an int64 can hold."""

_repr = reprlib.Repr()
_repr.maxstring = 40
_repr.maxother = 40
_repr.maxlevel = 2
_repr.maxlist = _repr.maxtuple = _repr.maxdict = 4


def show(value: Any) -> str:
    """A short ``repr`` of ``value`` for messages (long strings and deep lists are cut)."""
    try:
        return _repr.repr(value)
    except (RecursionError, ValueError):  # pathological nesting, ints beyond str() limits
        return f"a {type(value).__name__}"


def join_path(prefix: str, path: str) -> str:
    """``stages[1]`` + ``blocks`` → ``stages[1].blocks``; ``blocks`` + ``[0]`` → ``blocks[0]``.
    """
    if not prefix:
        return path
    if not path:
        return prefix
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


class RecordError(InvalidInputError):
    """A field of a record holds an impossible value.

    Attributes:
        path: where the field lies inside the record, e.g. ``"stages[1].blocks"``.
        problem: what is wrong, e.g. ``"is empty"``.
        record: the record's class name when raised by its constructor, else ``""``.
    """

    def __init__(self, path: str, problem: str, record: str = "") -> None:
        self.path, self.problem, self.record = path, problem, record
        where = f"{record}: " if record else ""
        super().__init__(f"{where}{path} {problem}" if path else f"{where}{problem}")

    def within(self, prefix: str) -> RecordError:
        """The same error seen from the record that holds this one at ``prefix``."""
        return RecordError(join_path(prefix, self.path), self.problem)

    def bare(self) -> str:
        """The message without the record's class name."""
        return f"{self.path} {self.problem}" if self.path else self.problem


def _integer(value: Any, path: str, minimum: int, rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError(path, f"is {show(value)} (a {type(value).__name__}): {rule}")
    if not minimum <= value <= MAX_INT:
        shown = show(value) if value < MAX_INT else "too large"
        raise RecordError(path, f"is {shown}: {rule}")


def check_size(value: Any, path: str) -> None:
    """A size or count that must be ≥ 1 (micro-batch sizes, batch size, micro-batches)."""
    _integer(value, path, 1, "sizes and counts must be integers ≥ 1")


def check_count(value: Any, path: str) -> None:
    """A count or index that may be 0 (warm-up runs, indices, tensor dimensions)."""
    _integer(value, path, 0, "counts and indices must be integers ≥ 0")


def check_bytes(value: Any, path: str) -> None:
    """A byte count: an integer ≥ 0."""
    _integer(value, path, 0, "byte counts must be integers ≥ 0")


def check_ms(value: Any, path: str, what: str = "times") -> None:
    """A time (ms) or another measured quantity: a finite number ≥ 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(path, f"is {show(value)} (a {type(value).__name__}): {what} must be "
                                "finite numbers ≥ 0")
    if not (math.isfinite(value) and value >= 0):
        raise RecordError(path, f"is {value}: {what} must be finite and ≥ 0")


def check_flag(value: Any, path: str) -> None:
    """A yes/no field: ``True`` or ``False`` (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        raise RecordError(path, f"is {show(value)} (a {type(value).__name__}): expected true "
                                "or false")


def check_text(value: Any, path: str, *, empty: bool = False) -> None:
    """A string; non-empty unless ``empty``."""
    if not isinstance(value, str):
        raise RecordError(path, f"is {show(value)} (a {type(value).__name__}): expected a string")
    if not empty and not value:
        raise RecordError(path, "is empty: expected a name")


def check_choice(value: Any, path: str, choices: Sequence[str]) -> None:
    """One of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise RecordError(path, f"is {show(value)}: use one of {', '.join(map(repr, choices))}")


def check_row(
    values: Any, path: str, each: Callable[[Any, str], None], *, nonempty: bool = False
) -> None:
    """A sequence (not a string) whose every item passes ``each``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise RecordError(path, f"is {show(values)} (a {type(values).__name__}): expected a list")
    if nonempty and not values:
        raise RecordError(path, "is empty")
    for i, value in enumerate(values):
        each(value, f"{path}[{i}]")


def check_length(values: Sequence[Any], path: str, expected: int, of: str) -> None:
    """``len(values) == expected``; ``of`` says what the length must match."""
    if len(values) != expected:
        raise RecordError(path, f"has {len(values)} values for {expected} {of}")


def check_unique(names: Sequence[tuple[str, str]], what: str) -> None:
    """Every name appears once; ``names`` holds (path, name) pairs in order."""
    seen: dict[str, str] = {}
    for path, name in names:
        if name in seen:
            raise RecordError(path, f"{show(name)} is repeated ({seen[name]} has it too): "
                                    f"{what} must be unique")
        seen[name] = path


# --------------------------------------------------------------------------- record invariants
# Each check raises RecordError with the field's path inside the record; the constructor adds
# the record's name (``checked``), and the JSON reader the path of the enclosing record and the
# file. The records pass their part classes in, so that this module needs none of them.


def checked(record: Any, check: Callable[[Any], None]) -> None:
    """Run ``check(record)``; its :class:`RecordError` names the record's class."""
    try:
        check(record)
    except RecordError as exc:
        raise RecordError(exc.path, exc.problem, type(record).__name__) from None


def is_a(cls: type) -> Callable[[Any, str], None]:
    """A check for :func:`check_row`: the value is a ``cls``."""

    def check(value: Any, path: str) -> None:
        if not isinstance(value, cls):
            raise RecordError(path, f"is {show(value)}: expected a {cls.__name__}")

    return check
