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
