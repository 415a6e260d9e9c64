"""How one call of a model, ``model(*args, **kwargs)``, becomes the graph's flat tensor inputs.

A captured graph takes its inputs flat: one placeholder per tensor of the call, in the order
``torch.utils._pytree`` flattens ``(args, kwargs)``. Everything else in the call (``None``,
``use_cache=False``, an int) was fixed when the model was captured: a later call must pass the
same value, or leave the keyword out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autosplit.errors import ArgumentTypeError, InvalidInputError

__all__ = ["InputSignature", "call_arguments", "example_call"]


def call_arguments(example_inputs: Any, example_kwargs: Any = None,
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from what a user gives: a tensor, a tuple of inputs, and a dict.

    Raises:
        ArgumentTypeError: ``example_inputs`` is not a tensor, tuple or list, or
            ``example_kwargs`` not a dict with string keys.
    """
    if example_inputs is None:
        args: tuple[Any, ...] = ()
    elif isinstance(example_inputs, torch.Tensor):
        args = (example_inputs,)
    elif isinstance(example_inputs, (tuple, list)):
        args = tuple(example_inputs)
    else:
        raise ArgumentTypeError(
            "example_inputs must be a tensor or a tuple of inputs, got "
            f"{type(example_inputs).__name__} (keyword inputs go in example_kwargs, a dict)"
        )
    if example_kwargs is None:
        return args, {}
    if not isinstance(example_kwargs, Mapping) or not all(
            isinstance(k, str) for k in example_kwargs):
        raise ArgumentTypeError(
            "example_kwargs must be a dict of keyword inputs ({'attention_mask': mask}), got "
            f"{type(example_kwargs).__name__}"
        )
    return args, dict(example_kwargs)


def example_call(value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from what a model file's ``example_inputs(batch_size)`` returns: a
    tensor, a tuple of positional inputs, a dict of keyword inputs, or both as
    ``(tuple, dict)``.

    Raises:
        ArgumentTypeError: anything else.
    """
    if isinstance(value, dict):
        return call_arguments(None, value)
    if (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], (tuple, list))
            and isinstance(value[1], dict)):
        return call_arguments(tuple(value[0]), value[1])
    return call_arguments(value, None)


@dataclass(frozen=True, slots=True)
class InputSignature:
    """The call a graph was captured from.

    Attributes:
        spec: the pytree structure of ``(args, kwargs)``.
        leaves: per leaf, the placeholder name of a tensor, or ``None`` for a fixed value.
        constants: per leaf, the fixed value where ``leaves`` holds ``None``.
        defaults: keyword inputs a call may leave out, with the value the capture used.
    """

    spec: pytree.TreeSpec
    leaves: tuple[str | None, ...]
    constants: tuple[Any, ...]
    defaults: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, args: Sequence[Any], kwargs: Mapping[str, Any], names: Sequence[str],
           defaults: Mapping[str, Any] | None = None) -> InputSignature:
        """The signature of the call ``(args, kwargs)``: its tensors, in flattening order, are
        the placeholders ``names``."""
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        it = iter(names)
        leaves = tuple(next(it) if isinstance(x, torch.Tensor) else None for x in flat)
        assert next(it, None) is None, "more placeholders than tensors in the call"
        constants = tuple(None if isinstance(x, torch.Tensor) else x for x in flat)
        return cls(spec, leaves, constants, tuple((defaults or {}).items()))

    @classmethod
    def positional(cls, names: Sequence[str]) -> InputSignature:
        """The signature of a call with one positional tensor per placeholder ``names``."""
        _, spec = pytree.tree_flatten((tuple(range(len(names))), {}))
        return cls(spec, tuple(names), (None,) * len(names))

    @property
    def names(self) -> tuple[str, ...]:
        """The placeholder names, in order."""
        return tuple(n for n in self.leaves if n is not None)

    @property
    def keywords(self) -> tuple[str, ...]:
        """The keyword inputs of the captured call."""
        kwargs_spec = self.spec.child(1)
        return tuple(kwargs_spec.context)

    def flatten(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None,
                model: str = "the model") -> tuple[torch.Tensor, ...]:
        """The graph's inputs for the call ``model(*args, **kwargs)``.

        Raises:
            InvalidInputError: the call does not have the captured call's structure (another
                number of inputs, a keyword missing or unknown, a fixed value changed).
        """
        kwargs = dict(kwargs or {})
        for name, value in self.defaults:
            kwargs.setdefault(name, value)
        wanted = self.keywords
        missing = [k for k in wanted if k not in kwargs]
        unknown = [k for k in kwargs if k not in wanted]
        if missing or unknown:
            what = "; ".join(filter(None, [
                missing and f"missing keyword(s) {', '.join(missing)}",
                unknown and f"unknown keyword(s) {', '.join(unknown)}"]))
            raise InvalidInputError(
                f"{model} was captured for a call {self.describe()}: {what}; call it with the "
                "keywords its example inputs had"
            )
        flat, spec = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in wanted}))
        if spec != self.spec and not wanted and all(c.is_leaf() for c in spec.child(0).children()) \
                and all(c.is_leaf() for c in self.spec.child(0).children()):
            raise InvalidInputError(
                f"{model} takes {len(self.leaves)} inputs ({', '.join(self.names)}), got "
                f"{len(flat)}"
            )
        if spec != self.spec:
            raise InvalidInputError(
                f"{model} was captured for a call {self.describe()}, not "
                f"{_describe(spec)}: call it the way its example inputs were given"
            )
        out = []
        for i, (value, name, constant) in enumerate(zip(flat, self.leaves, self.constants)):
            if name is not None:
                if not isinstance(value, torch.Tensor):
                    raise InvalidInputError(
                        f"{self._leaf_label(i)} of {model} is a {type(value).__name__}, not a "
                        "tensor (it was a tensor when the model was captured)"
                    )
                out.append(value)
            elif not _same(value, constant):
                raise InvalidInputError(
                    f"{self._leaf_label(i)} of {model} is {value!r}, but the model was "
                    f"captured with {constant!r}: a value that is not a tensor is fixed at "
                    "capture, so capture the model again with the new value"
                )
        return tuple(out)

    def unflatten(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of a call with these tensors (the inverse of :meth:`flatten`)."""
        it = iter(tensors)
        flat = [next(it) if name is not None else c for name, c in zip(self.leaves, self.constants)]
        args, kwargs = pytree.tree_unflatten(flat, self.spec)
        return tuple(args), dict(kwargs)

    def describe(self) -> str:
        """The captured call, e.g. ``(tensor, attention_mask=tensor)``."""
        return _describe(self.spec)

    def _leaf_label(self, i: int) -> str:
        """``"input 0"``, ``"keyword input 'mask'"`` (and the place inside it, if nested)."""
        numbered = pytree.tree_unflatten(list(range(len(self.leaves))), self.spec)
        for path, leaf in pytree.tree_flatten_with_path(numbered)[0]:
            if leaf != i:
                continue
            _, *inner = path
            key = inner[0] if inner else None
            head = (f"keyword input {key.key!r}" if isinstance(key, pytree.MappingKey)
                    else f"input {getattr(key, 'idx', '?')}")
            return head + pytree.keystr(tuple(inner[1:]))
        return f"input {i}"


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - values without a plain ==
        return a is b


def _describe(spec: pytree.TreeSpec) -> str:
    args_spec, kwargs_spec = spec.child(0), spec.child(1)
    parts = [f"{args_spec.num_children} positional input(s)"]
    if kwargs_spec.context:
        parts.append("keywords " + ", ".join(kwargs_spec.context))
    return "(" + "; ".join(parts) + ")"
