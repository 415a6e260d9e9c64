"""The public surface: every name in autosplit.__all__ resolves, whatever was imported first."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    for name in ("partition", "profile", "plan", "trace", "emit"):
        assert callable(getattr(autosplit, name)), name


def test_import_is_light() -> None:
    code = "import sys, autosplit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_planning_from_a_profile_file_needs_no_torch() -> None:
    fixture = Path(__file__).parent / "fixtures" / "resnet50_profile.json"
    code = ("import sys, autosplit\n"
            f"prof = autosplit.Profile.load({str(fixture)!r})\n"
            "plan = autosplit.plan(prof, 2)\n"
            "print(len(plan.stages), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2", "False"]


def test_every_error_class_is_exported_without_torch() -> None:
    code = (
        "import sys, autosplit\n"
        "from autosplit import errors\n"
        "names = errors.__all__\n"
        "assert all(getattr(autosplit, n) is getattr(errors, n) for n in names), names\n"
        "assert all(n in autosplit.__all__ for n in names), names\n"
        "assert {n for n in dir(errors) if n.endswith('Error')} - set(names) == "
        "{'PlanFileError', 'PlanMismatchError'}\n"
        "print(len(names), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["13", "False"]


def test_the_runtimes_raise_the_exported_classes() -> None:
    from autosplit import distributed, modelfile

    assert distributed.RankFailedError is autosplit.RankFailedError
    assert modelfile.ModelFileError is autosplit.ModelFileError
    assert issubclass(autosplit.ArgumentTypeError, autosplit.InvalidInputError)
    assert issubclass(autosplit.ArgumentTypeError, TypeError)


def test_the_public_surface_is_the_pipeline_records_and_errors() -> None:
    from autosplit import errors

    steps = {"partition", "trace", "profile", "plan", "emit"}
    options = {"PartitionOptions", "ProfileOptions", "PlanOptions"}  # the steps' inputs
    records = {"Profile", "BlockProfile", "CutProfile", "DeviceInfo", "Plan", "Stage",
               "SharedWeight"}
    assert set(autosplit.__all__) == (steps | options | records | set(errors.__all__)
                                      | {"__version__"})


def test_the_former_error_names_are_the_same_classes() -> None:
    from autosplit import errors

    assert errors.PlanFileError is errors.RecordFileError is autosplit.PlanFileError
    assert errors.PlanMismatchError is errors.ModelMismatchError is autosplit.PlanMismatchError
    assert issubclass(errors.RecordFileError, ValueError)
    assert issubclass(errors.ModelMismatchError, ValueError)


def test_moved_names_still_resolve_with_a_deprecation_warning() -> None:
    from autosplit import comparison, planner, specs

    for name, module in (("compare", comparison), ("plan_with_balance", planner),
                         ("get_spec", specs), ("calibrate", specs)):
        with pytest.warns(DeprecationWarning, match=f"use {module.__name__}.{name}"):
            assert getattr(autosplit, name) is getattr(module, name)
        assert name not in autosplit.__all__ and name not in dir(autosplit)


def test_a_device_spec_file_that_cannot_be_read_is_a_record_file_error(tmp_path) -> None:
    from autosplit.specs import load_spec

    bad = tmp_path / "spec.json"
    bad.write_text("{not json")
    with pytest.raises(autosplit.RecordFileError, match="spec.json' is not valid JSON"):
        load_spec(bad)
