"""autosplit: split a PyTorch model across several devices automatically.

    pm = autosplit.partition(model, (x,), gpus=2)   # trace, profile, plan, build
    out = pm(x)                                     # pipelined forward
    print(pm.plan)                                  # stages, cut points, split_size, predictions

The package exports the pipeline's steps (trace, profile, plan, emit, partition), their
option records (ProfileOptions, PlanOptions, PartitionOptions), the records and the errors.
Analysis helpers live in their modules: ``autosplit.comparison`` (compare, baseline_plans,
manual_plan), ``autosplit.simulator``, ``autosplit.estimate.analytic``, ``autosplit.specs``,
``autosplit.planner`` (plan_with_balance), ``autosplit.pipeline`` (PipelinedModule). The
torch-free parts (``autosplit.solve``, ``autosplit.records``, the errors) import without torch;
everything else is loaded on first use.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from autosplit.errors import (
    ArgumentTypeError,
    AutosplitError,
    CodegenError,
    CutValueError,
    InfeasiblePlanError,
    InvalidInputError,
    ModelFileError,
    ModelMismatchError,
    PlanFileError,  # noqa: F401 (former name of RecordFileError)
    PlanMismatchError,  # noqa: F401 (former name of ModelMismatchError)
    RankFailedError,
    RecordFileError,
    RendezvousError,
    ScheduleUnavailableError,
    TraceError,
)
from autosplit.records import (
    BlockProfile,
    CutProfile,
    DeviceInfo,
    Plan,
    Profile,
    SharedWeight,
    Stage,
)

if TYPE_CHECKING:
    from autosplit.capture.trace import trace
    from autosplit.codegen import emit
    from autosplit.measure.options import ProfileOptions
    from autosplit.measure.profiler import profile
    from autosplit.partitioning import PartitionOptions, partition
    from autosplit.planner import PlanOptions, plan

__version__ = "0.1.0"

_LAZY = {
    "partition": "autosplit.partitioning",
    "profile": "autosplit.measure.profiler",
    "plan": "autosplit.planner",
    "trace": "autosplit.capture.trace",
    "emit": "autosplit.codegen",
    "ProfileOptions": "autosplit.measure.options",
    "PartitionOptions": "autosplit.partitioning",
    "PlanOptions": "autosplit.planner",
}

_MOVED = {
    "PipelinedModule": "autosplit.pipeline",
    "plan_with_balance": "autosplit.planner",
    "BlockGraph": "autosplit.graph",
    "compare": "autosplit.comparison",
    "baseline_plans": "autosplit.comparison",
    "manual_plan": "autosplit.comparison",
    "simulate": "autosplit.simulator",
    "simulate_plan": "autosplit.simulator",
    "analytic_profile": "autosplit.estimate.analytic",
    "build_on_meta": "autosplit.estimate.analytic",
    "DeviceSpec": "autosplit.specs",
    "get_spec": "autosplit.specs",
    "load_spec": "autosplit.specs",
    "calibrate": "autosplit.specs",
}
"""Names that ``autosplit`` exported before 0.2, now in their modules; still found, with a
``DeprecationWarning`` that says where."""

__all__ = [
    "partition",
    "trace",
    "profile",
    "plan",
    "emit",
    "PartitionOptions",
    "ProfileOptions",
    "PlanOptions",
    "Profile",
    "BlockProfile",
    "CutProfile",
    "DeviceInfo",
    "Plan",
    "Stage",
    "SharedWeight",
    "AutosplitError",
    "InvalidInputError",
    "ArgumentTypeError",
    "TraceError",
    "InfeasiblePlanError",
    "ModelMismatchError",
    "RecordFileError",
    "CodegenError",
    "CutValueError",
    "ModelFileError",
    "RankFailedError",
    "ScheduleUnavailableError",
    "RendezvousError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        warnings.warn(
            f"autosplit.{name} is deprecated: use {_MOVED[name]}.{name} "
            f"(from {_MOVED[name]} import {name})",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'autosplit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
