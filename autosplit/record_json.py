"""The JSON round trip of the records: ``save_record`` / ``load_record`` (no torch import).

A record file is a JSON object ``{"kind": "plan" | "profile", "format_version": N, <fields>}``:
format 1 has the record's fields at the top level; format 2 (plans) groups them, each group an
object of its fields (``{"layout": {…}, "prediction": {…}, "provenance": {…}}``). Both load.
Reading rebuilds the dataclass field by field from its type hints, so a wrong type, a missing
or unknown field, or a broken invariant is a :class:`~autosplit.errors.PlanFileError` naming
the file and the field's path (``plan file 'p.json': layout.stages[1].blocks is empty``).

This module sits below :mod:`autosplit.records` (which calls it from ``save`` / ``load``) and
imports nothing of autosplit but errors, validation and atomic_write.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from autosplit.atomic_write import write_text_atomic
from autosplit.errors import PlanFileError
from autosplit.validation import RecordError, join_path, show

__all__ = ["FORMAT_VERSION", "GROUPED_VERSION", "Groups", "save_record", "load_record",
           "from_json"]

FORMAT_VERSION = 1
"""Version of a record file with its fields at the top level (profiles; plans before format 2)."""
GROUPED_VERSION = 2
"""Version of a record file with its fields in groups (plans)."""

Groups = dict[str, tuple[str, ...]]
"""Group name → the record's fields in it, in order; every field in exactly one group."""

T = TypeVar("T")


def save_record(value: Any, kind: str, path: str | Path, groups: Groups | None = None) -> None:
    """Write the record ``value`` (a dataclass) as JSON tagged with ``kind``: its fields in
    ``groups`` (:data:`GROUPED_VERSION`), or at the top level (:data:`FORMAT_VERSION`); the
    file is replaced whole or not at all (:func:`autosplit.atomic_write.write_text_atomic`)."""
    fields = dataclasses.asdict(value)
    if groups is None:
        data = {"kind": kind, "format_version": FORMAT_VERSION, **fields}
    else:
        data = {"kind": kind, "format_version": GROUPED_VERSION,
                **{group: {name: fields[name] for name in names}
                   for group, names in groups.items()}}
    write_text_atomic(path, json.dumps(data, indent=1, allow_nan=False) + "\n")


def load_record(cls: type[T], kind: str, path: str | Path, groups: Groups | None = None) -> T:
    """Read a record of ``kind`` from ``path`` (with ``groups``: format 2 or 1, else format 1);
    every problem is a :class:`PlanFileError` naming the file and, for a bad value, the
    field's path (in format 2 from its group: ``layout.stages[1].blocks``)."""
    path = Path(path)
    where = f"{kind} file {str(path)!r}"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlanFileError(f"{where} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanFileError(f"{where} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanFileError(f"{where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise PlanFileError(f"{where} is nested too deeply to be an autosplit {kind}") from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise PlanFileError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("kind") != kind:
        found = show(data.get("kind")) if isinstance(data, dict) else f"a {type(data).__name__}"
        raise PlanFileError(f"{str(path)!r} is not an autosplit {kind} file (kind: {found})")
    version = data.get("format_version")
    known = (FORMAT_VERSION,) if groups is None else (FORMAT_VERSION, GROUPED_VERSION)
    if type(version) is not int or version not in known:
        raise PlanFileError(
            f"{where} has format version {show(version)}; this autosplit reads version "
            f"{' or '.join(map(str, known))}: make it again"
        )
    body = {k: v for k, v in data.items() if k not in ("kind", "format_version")}
    try:
        if version == FORMAT_VERSION:
            return from_json(cls, body)
        assert groups is not None
        return _from_groups(cls, body, groups)
    except RecordError as exc:
        raise PlanFileError(f"{where}: {exc.bare()}") from None


def _from_groups(cls: type[T], body: dict[str, Any], groups: Groups) -> T:
    """The record of a format-2 ``body``: each group's fields, checked to be its own."""
    home = {name: group for group, names in groups.items() for name in names}
    fields: dict[str, Any] = {}
    for group, value in body.items():
        if group not in groups:
            raise RecordError(str(group), f"is not a group of a {cls.__name__} file (its "
                              f"groups: {', '.join(groups)})")
        if not isinstance(value, dict):
            raise RecordError(group, f"is {show(value)}: expected an object of fields")
        for name, field_value in value.items():
            if home.get(name, group) != group:
                raise RecordError(join_path(group, str(name)),
                                  f"belongs in {home[name]}, not in {group}")
            fields[name] = field_value
            home.setdefault(name, group)  # an unknown field: named where it was found
    try:
        return from_json(cls, fields)
    except RecordError as exc:
        head = exc.path.split(".", 1)[0].split("[", 1)[0]
        raise RecordError(join_path(home[head], exc.path) if head in home else exc.path,
                          exc.problem) from None


def from_json(tp: Any, value: Any, path: str = "") -> Any:
    """Rebuild a value of (annotated) type ``tp`` from its ``json.loads`` form.

    Raises:
        RecordError: a value has the wrong type, a field is missing or unknown, or a record's
            invariant does not hold; the error's path is ``path`` and the place below it.
    """
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecordError(path, f"is {show(value)}: expected an object (a {tp.__name__})")
        hints = typing.get_type_hints(tp)
        fields = dataclasses.fields(tp)
        for key in value:
            if key not in hints:
                raise RecordError(join_path(path, str(key)), f"is not a field of a {tp.__name__} "
                                  f"(its fields: {', '.join(f.name for f in fields)})")
        kwargs = {k: from_json(hints[k], v, join_path(path, k)) for k, v in value.items()}
        for f in fields:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and f.name not in value:
                raise RecordError(join_path(path, f.name), "is missing")
        try:
            return tp(**kwargs)
        except RecordError as exc:
            raise exc.within(path) from None
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return from_json(inner[0], value, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise RecordError(path, f"is {show(value)}: expected a list")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_json(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise RecordError(path, f"has {len(value)} items: expected {len(args)}")
        return tuple(from_json(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if tp is bool:
        if not isinstance(value, bool):
            raise RecordError(path, f"is {show(value)}: expected true or false")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecordError(path, f"is {show(value)}: expected a number")
        try:
            return float(value)
        except OverflowError:
            raise RecordError(path, "is too large: expected a finite number") from None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(path, f"is {show(value)}: expected an integer")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise RecordError(path, f"is {show(value)}: expected a string")
        return value
    raise TypeError(f"cannot read a value of type {tp!r}")  # internal: a record field's type
