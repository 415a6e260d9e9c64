"""The public surface: every name in autosplit.__all__ resolves, whatever was imported first."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import autosplit


def test_public_functions_are_not_shadowed_by_submodules() -> None:
    # importing every submodule first must not replace a public function by a module
    for info in pkgutil.walk_packages(autosplit.__path__, "autosplit."):
        if info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)
    for name in autosplit.__all__:
        value = getattr(autosplit, name)
        assert not isinstance(value, type(autosplit)) or name == "solve", f"{name} is a module"
    for name in ("partition", "profile", "plan", "trace", "compare", "simulate", "emit"):
        assert callable(getattr(autosplit, name)), name


def test_import_is_light() -> None:
    code = "import sys, autosplit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_error_class_is_exported_without_torch() -> None:
    code = (
        "import sys, autosplit\n"
        "from autosplit import errors\n"
        "names = [n for n in dir(errors) if n.endswith('Error')]\n"
        "assert all(getattr(autosplit, n) is getattr(errors, n) for n in names), names\n"
        "assert all(n in autosplit.__all__ for n in names), names\n"
        "print(len(names), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["10", "False"]


def test_the_runtimes_raise_the_exported_classes() -> None:
    from autosplit import distributed, modelfile

    assert distributed.RankFailedError is autosplit.RankFailedError
    assert modelfile.ModelFileError is autosplit.ModelFileError
    assert issubclass(autosplit.ArgumentTypeError, autosplit.InvalidInputError)
    assert issubclass(autosplit.ArgumentTypeError, TypeError)
