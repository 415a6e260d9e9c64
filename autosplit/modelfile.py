"""Load a model file: a Python file (or module) that says how to build a model and its inputs.

A model file defines ``build_model()`` (or a module-level ``model``) and, optionally,
``example_inputs(batch_size)`` returning a tensor, a tuple of positional inputs, a dict of
keyword inputs, or both as ``(tuple, dict)``; ``GRANULARITY`` and ``LEAF_MODULES`` say how to
capture the model (as ``--granularity`` and ``--leaf-modules`` do). ``--entry
FILE_OR_MODULE:CALLABLE`` names another factory. Every failure is a :class:`ModelFileError`
whose message fits on one line.

The model file's own code (its import, the factory, ``example_inputs``) runs with ``sys.argv``
set to ``[the file]``, so a file that parses the command line sees no arguments, and with its
``stderr`` held back until it returns: a ``sys.exit()`` in it (argparse's usage error included)
becomes a :class:`ModelFileError` that quotes the last line it wrote, instead of ending the
program.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import io
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from autosplit.errors import ModelFileError

__all__ = [
    "ModelFile",
    "ModelFileError",
    "import_file",
    "load_model_file",
    "parse_model_args",
    "MODEL_NAMES",
    "INPUT_NAMES",
]

MODEL_NAMES = ("build_model", "model")
INPUT_NAMES = ("example_inputs",)


@dataclass(frozen=True, slots=True)
class ModelFile:
    """What a model file provides.

    Attributes:
        path: the file (or ``None`` when given as an importable module name).
        module_name: the name it was imported under.
        ref: how generated code should find the factory again, ``"path/to/file.py:build_model"``.
        factory: builds a fresh model (for a module-level ``model``, returns that object).
        inputs: ``example_inputs(batch_size)`` when the file defines it, else ``None``.
        default_batch_size: ``example_inputs``' default batch size, when it has one.
        manual_split: the file's hand-written split, ``MANUAL_SPLIT`` (first block or module of
            every stage after the first, e.g. ``["layer3"]``), or ``None``.
        manual_split_size: ``MANUAL_SPLIT_SIZE``, the hand-written split's micro-batch size.
        granularity: ``GRANULARITY`` (``"block"`` or ``"layer"``), how to capture the model.
        leaf_modules: ``LEAF_MODULES``, module names or classes capture must not enter.
    """

    path: Path | None
    module_name: str
    ref: str
    factory: Callable[[], Any]
    inputs: Callable[..., Any] | None
    default_batch_size: int | None
    manual_split: tuple[str, ...] | None = None
    manual_split_size: int | None = None
    granularity: str | None = None
    leaf_modules: tuple[Any, ...] = ()

    def build(self, **kwargs: Any) -> Any:
        """Build the model (``kwargs`` go to the factory, see :func:`parse_model_args`), turning
        its errors into one-line :class:`ModelFileError`."""
        accepted = _accepted(self.factory, kwargs, "the model factory", self.ref)
        try:
            with self._running(f"in {self.ref.rpartition(':')[2]}"):
                model = self.factory(**accepted)
        except ModelFileError:
            raise
        except Exception as exc:
            raise ModelFileError(
                f"building the model from {self.ref} failed: {_one_line(exc)}"
            ) from exc
        import torch

        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(
                f"{self.ref} returned a {type(model).__name__}, not a torch.nn.Module"
            )
        return model

    def example_inputs(self, batch_size: int | None, **kwargs: Any) -> Any:
        """Call ``example_inputs(batch_size)`` (its default when ``None``), passing on those of
        ``kwargs`` it accepts."""
        if self.inputs is None:
            raise ModelFileError(
                f"{self.ref.split(':')[0]} defines no example_inputs(batch_size): add it, or give "
                "--input-shape C,H,W and --batch-size N"
            )
        extra = _accepted(self.inputs, kwargs, None, self.ref)
        try:
            with self._running("in example_inputs"):
                if batch_size is None:
                    return self.inputs(**extra)
                return self.inputs(batch_size, **extra)
        except ModelFileError:
            raise
        except Exception as exc:
            raise ModelFileError(
                f"example_inputs({batch_size or ''}) failed: {_one_line(exc)}"
            ) from exc


    def _running(self, where: str) -> contextlib.AbstractContextManager[None]:
        shown = self.ref.rpartition(":")[0]
        return _model_code(shown, str(self.path) if self.path else shown, where)


@contextlib.contextmanager
def _model_code(shown: str, argv0: str, where: str) -> Iterator[None]:
    """Run the model file's code with ``sys.argv == [argv0]`` and its stderr held back; turn its
    ``sys.exit()`` into a :class:`ModelFileError` (``where``: e.g. ``"in build_model"``)."""
    argv, stderr = sys.argv, sys.stderr
    held = io.StringIO()
    sys.argv, sys.stderr = [argv0], held
    try:
        yield
    except SystemExit as exc:
        said = [line.strip() for line in held.getvalue().splitlines() if line.strip()]
        raise ModelFileError(
            f"model file {shown} called sys.exit({exc.code!r}) {where}"
            + (f": {said[-1]}" if said else "")
        ) from None
    else:
        sys.stderr = stderr
        stderr.write(held.getvalue())  # what it wrote on success is passed on
    finally:
        sys.argv, sys.stderr = argv, stderr


def parse_model_args(items: Sequence[str]) -> dict[str, Any]:
    """``["size=7b", "layers=4"]`` → ``{"size": "7b", "layers": 4}`` (ints, floats, booleans
    and ``None`` are recognised; anything else stays a string).

    Raises:
        ModelFileError: an item is not ``KEY=VALUE``.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise ModelFileError(f"model argument {item!r} is not KEY=VALUE, e.g. size=7b")
        value: Any = text
        for convert in (int, float):
            try:
                value = convert(text)
                break
            except ValueError:
                continue
        value = {"true": True, "false": False, "none": None}.get(text.lower(), value)
        out[key] = value
    return out


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any], strict: str | None,
              ref: str) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes; with ``strict``, an unknown one is an error."""
    if not kwargs:
        return {}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return dict(kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    unknown = sorted(set(kwargs) - set(params))
    if unknown and strict:
        raise ModelFileError(
            f"{strict} of {ref} takes no argument {', '.join(unknown)}: it takes "
            f"{', '.join(params) or 'no arguments'}"
        )
    return {k: v for k, v in kwargs.items() if k in params}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def import_file(path: Path, shown: str) -> ModuleType:
    name = f"autosplit_model_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"cannot import {str(path)!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent = str(path.parent)
    added = parent not in sys.path
    if added:
        sys.path.insert(0, parent)  # let the file import its neighbours
    try:
        with _model_code(shown, str(path), "while being imported"):
            spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(name, None)
        if isinstance(exc, (KeyboardInterrupt, ModelFileError)):
            raise
        raise ModelFileError(f"importing {str(path)!r} failed: {_one_line(exc)}") from exc
    finally:
        if added:
            sys.path.remove(parent)
    return module


def load_model_file(target: str, entry: str | None = None) -> ModelFile:
    """Load a model file.

    Args:
        target: a path to a ``.py`` file, or an importable module name.
        entry: ``"FILE_OR_MODULE:CALLABLE"`` or ``"CALLABLE"`` (in ``target``) naming the
            model factory; default: ``build_model`` or ``model`` in ``target``.

    Raises:
        ModelFileError: the file is missing, raises on import, or defines no model.
    """
    source, attr = target, None
    if entry:
        source, _, attr = entry.rpartition(":") if ":" in entry else (target, "", entry)
        source = source or target
    path: Path | None = Path(source)
    assert path is not None
    if source.endswith(".py") or path.exists():
        if not path.is_file():
            raise ModelFileError(f"model file {source!r} does not exist")
        path = path.resolve()
        shown = str(Path(source))
        module = import_file(path, shown)
    else:
        try:
            with _model_code(source, source, "while being imported"):
                module = importlib.import_module(source)
        except ModelFileError:
            raise
        except Exception as exc:
            raise ModelFileError(f"cannot import module {source!r}: {_one_line(exc)}") from exc
        path = None
        shown = source
    names = (attr,) if attr else MODEL_NAMES
    found = next((n for n in names if hasattr(module, n)), None)
    if found is None:
        raise ModelFileError(
            f"{shown} defines no model: looked for {' or '.join(names)}; define build_model() "
            "returning an nn.Module, or name the factory with --entry FILE:CALLABLE"
        )
    value = getattr(module, found)
    factory: Callable[[], Any] = (value if callable(value) and not _is_module(value)
                                  else (lambda: value))
    inputs = getattr(module, INPUT_NAMES[0], None)
    default = None
    if callable(inputs):
        try:
            param = next(iter(inspect.signature(inputs).parameters.values()), None)
        except (TypeError, ValueError):
            param = None
        if param is not None and isinstance(param.default, int):
            default = param.default
    else:
        inputs = None
    split = getattr(module, "MANUAL_SPLIT", None)
    split_size = getattr(module, "MANUAL_SPLIT_SIZE", None)
    if split is not None and (
        isinstance(split, str) or not all(isinstance(x, str) for x in split)
    ):
        raise ModelFileError(f"{shown}: MANUAL_SPLIT must be a list of block names, got {split!r}")
    if split_size is not None and (not isinstance(split_size, int) or split_size < 1):
        raise ModelFileError(
            f"{shown}: MANUAL_SPLIT_SIZE must be a positive integer, got {split_size!r}")
    granularity = getattr(module, "GRANULARITY", None)
    if granularity not in (None, "block", "layer"):
        raise ModelFileError(f"{shown}: GRANULARITY must be 'block' or 'layer', got "
                             f"{granularity!r}")
    leaves = getattr(module, "LEAF_MODULES", ())
    if isinstance(leaves, str) or not isinstance(leaves, (list, tuple)) or not all(
            isinstance(x, (str, type)) for x in leaves):
        raise ModelFileError(f"{shown}: LEAF_MODULES must be a list of module names or "
                             f"classes, got {leaves!r}")
    return ModelFile(
        path=path,
        module_name=module.__name__,
        ref=f"{shown}:{found}",
        factory=factory,
        inputs=inputs,
        default_batch_size=default,
        manual_split=tuple(split) if split is not None else None,
        manual_split_size=split_size,
        granularity=granularity,
        leaf_modules=tuple(leaves),
    )


def _is_module(value: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(value, torch.nn.Module)
